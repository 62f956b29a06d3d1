"""Test infrastructure only: a stand-in for ``sgl_kernel`` (SGLang's CPU kernels ship as
``sglang-kernel-cpu``, a source build that is not on PyPI; PyPI's ``sglang-kernel`` is the
CUDA build). SGLang 0.5.23 imports ``sgl_kernel`` at module level on CPU
(``sglang/kernels/ops/kvcache/cache_move.py``) but, on a CPU without AMX and with
``--attention-backend torch_native``, calls none of its kernels for the tiny test models.
Every attribute is a function that raises, so a kernel that is ever called fails loudly
instead of computing something else."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this sgl_kernel is the tests' stand-in "
            "(python/sglang-plugin/tests/serving/site); install sglang-kernel-cpu to run "
            "SGLang's CPU kernels"
        )

    kernel.__name__ = name
    return kernel
