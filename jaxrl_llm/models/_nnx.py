"""`flax.nnx`, imported without importing IPython where this process is not running in it.

Importing `flax.nnx` asks IPython whether it runs inside it (`get_ipython() is not None`,
in `flax.nnx.reprlib`, `summary` and `visualization`), and importing IPython to ask takes
about half a second where it is installed, on every start of the trainer. A process that
runs in IPython has imported it already; in any other the answer is no, so while flax.nnx
loads, IPython is marked absent (`sys.modules["IPython"] = None`) and flax reads the same
answer without loading it. IPython stays importable afterwards; treescope, which flax
imports meanwhile, then has no IPython display in this process (it needs a running
IPython anyway).
"""

import sys

if "IPython" in sys.modules or "flax.nnx" in sys.modules:
    from flax import nnx
else:
    sys.modules["IPython"] = None
    try:
        from flax import nnx
    finally:
        if sys.modules.get("IPython", 0) is None:
            del sys.modules["IPython"]

__all__ = ["nnx"]
