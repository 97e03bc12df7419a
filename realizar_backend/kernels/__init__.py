"""CUDA C++ sources of the GPU backend (*.cu, *.cuh), the catalogue of the modules the loader
builds from them (catalog.py), and those modules prebuilt for common GPUs (cubin/)."""
