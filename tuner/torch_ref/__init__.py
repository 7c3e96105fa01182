"""PyTorch implementations of a spec: the eager and ``torch.compile`` baselines, and the
hand-written kernels torch ships for some catalog cascades.

The modules, each with one job (this package re-exports nothing: import from the module):

- :mod:`~tuner.torch_ref.contractions`: which ``sum`` steps are contractions (einsum, tensor
  cores), their FLOPs, and the dtype and matmul precision they run at;
- :mod:`~tuner.torch_ref.builder`: :func:`~tuner.torch_ref.builder.build`, **any** spec as a
  plain function of torch tensors (the eager baseline, and wrapped in ``torch.compile`` the
  Inductor baseline);
- :mod:`~tuner.torch_ref.handwritten`: :func:`~tuner.torch_ref.handwritten.handwritten`, the
  kernel torch ships for a spec with the exact structure of a catalog spec, or why there is none.

Example:
    >>> import torch
    >>> from fuser_core.problem import make_problem
    >>> from fuser_core.spec import load_spec
    >>> from tuner.torch_ref.builder import build
    >>> from tuner.torch_ref.handwritten import HANDWRITTEN_TEMPLATES, handwritten
    >>> spec = load_spec(HANDWRITTEN_TEMPLATES["safe_softmax"])
    >>> fn = build(make_problem(spec, {"m": 2, "n": 5}, {"x": "float32"}))
    >>> x = torch.randn(2, 5)
    >>> torch.allclose(fn({"x": x})["y"], torch.softmax(x, -1))
    True
    >>> hand = handwritten(spec)
    >>> hand.name, torch.allclose(hand.fn({"x": x}, {"m": 2, "n": 5})["y"], torch.softmax(x, -1))
    ('torch.softmax', True)
"""
