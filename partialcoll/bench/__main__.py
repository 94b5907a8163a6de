"""python -m partialcoll.bench"""
from . import main

main()
