"""fastlm's Triton kernels, each with its backward, wrapped as autograd functions."""
