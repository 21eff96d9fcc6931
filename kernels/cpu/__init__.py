"""C++ kernels for the CPU, built on first use with torch's extension loader."""
