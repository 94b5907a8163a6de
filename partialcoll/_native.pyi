# Type stub of the native module that native/build_engine.py builds with cffi: its ffi and
# lib objects are made at build time from pc_engine.h, so they are typed as cffi's.
from typing import Any

ffi: Any
lib: Any
