import pytest


@pytest.fixture(scope="session")
def kernels():
    from realizar_backend.backends.cuda.modules import get_kernels
    return get_kernels(0)


@pytest.fixture
def fp16_expert_records(monkeypatch):
    """Whole-model parity of the tiny mixtures of experts (qwen3moe, qwen35moe, gpt-oss) runs the
    grouped experts on fp16 records (fp32-class sums), not on the 8-bit ones (dispatch.MOE_GROUPED_A8)
    that their stacks would take: those round the rows h and the gated rows to 8 bits per 32-value unit (about 1e-2
    relative on the experts' outputs of these models), and these random routers sit so near ties
    (most rows of a run meet one within parity.ROUTE_TIE) that later layers then route away from
    the oracle at gaps the tie rule does not excuse, and a different chunking writes other greedy
    tokens. test_moe.py checks the 8-bit records' launches against the activations as quantized."""
    from realizar_backend.backends.cuda import dispatch
    monkeypatch.setattr(dispatch, "MOE_GROUPED_A8", False)


@pytest.fixture
def fp32_expert_activations(fp16_expert_records, monkeypatch):
    """fp16_expert_records, and one-row steps' experts on moe.cu's pairs (fp32 activations), not on
    mmv8.cu's 8-bit ones (dispatch.MOE_PAIRS8), for a whole-model test that compares greedy tokens
    without parity.ROUTE_TIE's rule (test_gptoss_gpu.py): at some seeds the tiny gpt-oss model's
    routes moved with the 8-bit rows. test_moe.py checks the 8-bit pairs against the activations as
    quantized."""
    from realizar_backend.backends.cuda import dispatch
    monkeypatch.setattr(dispatch, "MOE_PAIRS8", False)
