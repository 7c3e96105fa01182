"""The backward pass of a cascade: its vector-Jacobian products derived as cascades of the same
grammar (:mod:`fuser_core.backward.derive`), their certificate against torch's float64 autograd
of the forward's formula (:mod:`fuser_core.backward.certify`), and a loss's gradient written by
its forward (:mod:`fuser_core.backward.in_forward`)."""
