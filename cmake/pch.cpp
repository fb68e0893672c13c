// Empty translation unit that carries the executables' precompiled LibTorch header.
