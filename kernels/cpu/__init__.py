"""C++ kernels for the CPU, built with the package (setup.py) and loaded by extension.py."""
