"""Builds the native engine with cffi; all metadata lives in setup.cfg."""
from setuptools import setup

setup(cffi_modules=["native/build_engine.py:ffibuilder"])
