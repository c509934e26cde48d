"""The benchmark scripts without a GPU: what they feed each implementation, and their plumbing.

The timings need CUDA; here each script's inputs are checked at tiny sizes (every implementation
of a packed attention batch, every batch shape of the Hugging Face rows computes what the
reference computes), the plans say what gpu_check.sh relies on, the measuring loop turns timings
into rows and files (with a stand-in timer), and without CUDA every script says so and exits 0.
"""

import csv
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastlm.testing import assert_close

# Appended: benchmarks/ holds attention.py, kernels.py and train.py, which must not shadow
# anything another test imports.
sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
common = importlib.import_module("_common")
attention = importlib.import_module("attention")  # benchmarks/attention.py
kernels = importlib.import_module("kernels")
moe = importlib.import_module("moe")
train = importlib.import_module("train")
pytestmark = pytest.mark.usefixtures("one_thread")  # two threads on two busy cores: far slower


@pytest.mark.parametrize("total", [16384, 65536])
def test_document_lengths_are_mixed_and_fill_the_batch(total):
    lengths = attention.document_lengths(total)
    assert sum(lengths) == total and min(lengths) >= 1
    assert min(lengths) < 64 and max(lengths) > 2048, "short documents beside long ones"
    assert lengths == attention.document_lengths(total), "the same batch on every run"


def test_varlen_implementations_compute_the_same_attention(device, monkeypatch):
    monkeypatch.setattr(attention, "_flex_attention", lambda: None)  # needs CUDA
    monkeypatch.setattr(common, "DEVICE", device)
    packed = attention.Packed.of([5, 1, 17, 2])
    assert packed.cu_seqlens.tolist() == [0, 5, 6, 23, 25]
    assert packed.positions.tolist()[4:8] == [4, 0, 0, 1]
    impls = attention.varlen_implementations(packed)
    assert {"fastlm", "fastlm padded", "sdpa block-diagonal mask"} <= set(impls)
    q, k, v = (torch.randn(25, 2, 16, device=device) for _ in range(3))
    ref = attention.varlen_reference(packed)(*(t.double() for t in (q, k, v)))
    for name, fn in impls.items():
        if not name.startswith("flash-attn"):
            assert_close(fn(q, k, v), ref, torch.float32, name)


@pytest.mark.parametrize("window", [7, None])
def test_family_implementations_compute_the_same_attention(device, monkeypatch, window):
    """--families: gpt-oss's eager attention, fastlm with sinks and FlexAttention with its
    log-sum-exp corrected for the sink (uncompiled here: compiled, it needs CUDA) agree, window
    or not; MLA's padded SDPA, plain SDPA and fastlm with v's own head dim agree."""
    flex = importlib.import_module("torch.nn.attention.flex_attention")
    monkeypatch.setattr(
        attention, "_flex_attention", lambda: (flex.flex_attention, flex.create_block_mask)
    )
    q, k, v = torch.randn(1, 8, 50, 16, device=device), *torch.randn(2, 1, 2, 50, 16, device=device)
    sinks = torch.randn(8, device=device)
    impls = attention.gpt_oss_implementations(window)
    assert set(impls) == {"fastlm", "eager", "flex (lse-corrected sinks)"}
    ref = impls["eager"](*(t.double() for t in (q, k, v, sinks)))
    for name, fn in impls.items():
        assert_close(fn(q, k, v, sinks), ref, torch.float32, name)
    monkeypatch.setitem(attention.MLA, "head_dim", 24)
    q, k, v = torch.randn(2, 1, 2, 40, 24, device=device).unbind(0) + (
        torch.randn(1, 2, 40, 16, device=device),
    )
    impls = attention.mla_implementations()
    ref = impls["sdpa v padded"](*(t.double() for t in (q, k, v)))
    for name, fn in impls.items():
        assert_close(fn(q, k, v), ref, torch.float32, name)


def test_headline_times_both_backward_schedules():
    """The first GPU run must say which backward schedule should be the default: the headline
    times fastlm's forward+backward with each, and --skip-headline times the rest."""
    parse = attention.parser().parse_args
    headline = attention.plan(parse(["--headline"]))
    assert [shape for shape, _ in headline] == attention.headline_shapes()
    for _, modes in headline:
        assert "fwd+bwd" in modes["fastlm"] and "fwd+bwd" in modes[attention.ATOMIC]
        assert "fwd" not in modes[attention.ATOMIC], "its forward is fastlm's"
    rest = dict(attention.plan(parse(["--quick", "--skip-headline"])))
    for shape in attention.headline_shapes():
        assert rest[shape][attention.ATOMIC] == ("bwd",) and rest[shape]["fastlm"] == ("bwd",)
    assert attention.ATOMIC in attention.implementations()


def test_kernel_cases_put_the_headline_first():
    def cases(*argv):
        return [(op.name, m, n) for op, m, n in kernels.cases(kernels.parser().parse_args(argv))]

    headline = [(op.name, *op.sizes[0]) for op in kernels.OPS if not op.fused]
    assert len(headline) == 6  # every op but fused linear cross-entropy
    assert cases("--headline") == headline
    assert cases("--quick") == [*headline, (kernels.LCE, 16384, 768)]
    full = cases()
    assert full[: len(headline) + 1] == cases("--quick")
    # the norms, RoPE, SwiGLU on the grid; gpt-oss's gate at one size; CE; fused
    assert len(full) == len(set(full)) == 4 * 9 + 1 + 2 + 2
    assert not set(cases("--skip-headline")) & set(headline)
    assert cases("--quick", "--ops", "swiglu") == [("swiglu", 16384, 4096)]


def test_measuring_loop_makes_rows_and_files(tmp_path, monkeypatch):
    """attention.bench with a stand-in timer (every timed call runs once and "takes" 2 ms): one
    row per implementation and mode, TFLOP/s from the FLOP count, the output check's error, and
    the CSV, JSON and summary written."""
    calls = []

    def bench_ms(fn, args, *, graph=False, grad_to_none=None):
        fn()
        calls.append(graph)
        return 2.0

    monkeypatch.setattr(common, "bench_ms", bench_ms)
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # the loop under test, not the kernels
    args = attention.parser().parse_args(["--varlen", "--out", str(tmp_path)])
    run = common.Run("attention_varlen", args, attention.VARLEN_COLUMNS, 60)
    packed = attention.Packed.of([3, 6])
    impls = attention.varlen_implementations(packed)
    impls = {name: impls[name] for name in ("fastlm", "sdpa block-diagonal mask")}
    wrong = lambda q, k, v: impls["fastlm"](q, k, v) * 2  # noqa: E731
    impls["wrong"] = wrong
    row = dict(case="varlen causal", tokens=9, docs=2, longest=6)
    build = lambda: (impls, attention.random_inputs(9, 2, 16), attention.varlen_reference(packed))  # noqa: E731
    attention.bench(run, [(row, build, 1e9, {})])
    assert run.finish(["summary line"]) == 0
    assert [(r["impl"], r["mode"]) for r in run.rows] == [
        (name, mode) for name in impls for mode in common.MODES
    ]
    for r in run.rows:
        assert r["ms"] == 2.0
        assert r["TFLOP/s"] == pytest.approx(attention.FLOP_FACTOR[r["mode"]] * 1e9 / 2e-3 / 1e12)
        assert (r["rel err"] > 0.5) == (r["impl"] == "wrong"), r
    assert len(calls) == 3 * len(impls) and not any(calls)
    written = json.loads((tmp_path / "attention_varlen.json").read_text())
    assert len(written["rows"]) == len(run.rows) and written["stopped"] is None
    assert len((tmp_path / "attention_varlen.csv").read_text().splitlines()) == 1 + len(run.rows)
    assert (tmp_path / "attention_varlen_summary.md").read_text() == "summary line\n"


# Llama-3's options at tiny sizes, logits far from uniform (so that each prediction counts).
TINY_LLAMA = train.LLAMA3_LAYERS | dict(vocab_size=97, hidden_size=32, intermediate_size=64)
TINY_LLAMA |= dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
TINY_LLAMA |= dict(max_position_embeddings=64, initializer_range=0.5)


def test_hf_rows_feed_every_model_the_same_documents(monkeypatch):
    """train.py --hf: the padded batch, the padding-free one (DataCollatorWithFlattening's) and
    fastlm's packed one hold the same documents and count the same predictions, so every row's
    model gives the unpatched padded loss (PyTorch math inside fastlm: the batches are checked
    here, the kernels in tests/test_hf.py)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    lengths = [5, 1, 9, 3]
    batches = train.hf_batches(lengths, TINY_LLAMA["vocab_size"], "cpu")
    padded, free = batches[train.PADDED], batches[train.PADDING_FREE]
    assert padded["input_ids"].shape == (4, 9) and free["input_ids"].shape == (1, 18)
    assert free["cu_seq_lens_q"].tolist() == [0, 5, 6, 15, 18] and free["max_length_q"] == 9
    assert padded["attention_mask"].sum() == 18 and (padded["labels"] == -100).sum() == 36 - 18
    losses = {}
    for kind, shape in train.HF_KINDS:
        if kind != train.LIGER:
            model, loss_fn = train.hf_model(kind, TINY_LLAMA, "cpu")
            losses[kind, shape] = loss_fn(
                model, **batches["packed" if kind == train.VARLEN else shape]
            )
    expected = losses[train.HF, train.PADDED]
    for key, loss in losses.items():
        assert_close(loss, expected, torch.float32, str(key))


@pytest.mark.skipif(common.HAS_CUDA, reason="the path without CUDA")
@pytest.mark.parametrize("script", ["attention", "kernels", "train"])
def test_without_cuda_each_script_says_so_and_exits_0(script, capsys, tmp_path):
    module = importlib.import_module(script)
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    assert "no CUDA device, nothing to measure" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_source_fingerprint_follows_the_sources(tmp_path):
    (tmp_path / "fastlm").mkdir()
    (tmp_path / "fastlm" / "a.py").write_text("x = 1\n")
    (tmp_path / "fastlm" / "notes.txt").write_text("not a source")
    first = common.source_fingerprint(tmp_path)
    (tmp_path / "fastlm" / "notes.txt").write_text("changed")
    assert common.source_fingerprint(tmp_path) == first
    (tmp_path / "fastlm" / "a.py").write_text("x = 2\n")
    assert common.source_fingerprint(tmp_path) != first


@pytest.mark.skipif(common.HAS_CUDA, reason="the path without CUDA")
def test_env_without_cuda_writes_env_json_and_exits_3(tmp_path):
    """gpu_check.sh's setup step: env.json with the versions and the modules that do not
    import, then exit 3 (no GPU)."""
    args = ["env", "--out", str(tmp_path), "--require", "json", "no_such_module", "--need-cuda"]
    script = common.REPO / "benchmarks" / "_common.py"
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert result.returncode == 3, result.stderr
    assert "no CUDA device" in result.stderr
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["missing_modules"] == "no_such_module"
    assert env["gpu"].startswith("none") and env["source"] == common.source_fingerprint()
    assert {"torch", "triton", "commit", "liger_kernel"} <= set(env)


def test_attention_plot_draws_each_panel(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        dict(dtype="bf16", D=128, B=b, N=n, mode="fwd", impl=impl, **{"TFLOP/s": t})
        for b in (1, 4)
        for n, t in ((1024, 100.0), (4096, 300.0))
        for impl in ("fastlm", "sdpa-flash")
    ] + [
        dict(dtype="bf16", D=128, B=1, N=65536, mode="fwd", impl="reference", **{"TFLOP/s": "OOM"})
    ]
    path = tmp_path / "attention.png"
    assert attention.plot(rows, path, "test") == f"wrote {path}"
    assert path.read_bytes().startswith(b"\x89PNG")
    assert attention.plot(rows[-1:], tmp_path / "none.png", "test") == "no plot: nothing measured"


class _Event:
    """torch.cuda.Event on the host clock."""

    def __init__(self, **kwargs):
        self.time = 0.0

    def record(self):
        self.time = time.perf_counter()

    def elapsed_time(self, end):
        return (end.time - self.time) * 1e3


@pytest.fixture
def cuda_stand_ins(monkeypatch, tmp_path):
    """A script's CUDA path on the CPU: torch.cuda's calls stand in, every timing "takes" 0.7 ms
    (0.5 from CUDA graphs), torch.compile returns the function (compiling is not under test),
    PyTorch inside fastlm's ops (the kernels are tests/' business). Yields --out's folder."""
    monkeypatch.setattr(common, "HAS_CUDA", True)
    monkeypatch.setattr(common, "bench_ms", lambda fn, args, graph=False, **_: (fn(), 0.7)[1])
    monkeypatch.setattr(torch, "compile", lambda fn=None, **_: fn or (lambda f: f))
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    stand_ins = dict(
        synchronize=lambda *_: None,
        empty_cache=lambda: None,
        memory_allocated=lambda *_: 0,
        reset_peak_memory_stats=lambda *_: None,
        max_memory_allocated=lambda *_: 2**20,
        Event=_Event,
        get_device_name=lambda *_: "stand-in GPU",
        get_device_properties=lambda *_: SimpleNamespace(multi_processor_count=1, total_memory=1),
    )
    for name, value in stand_ins.items():
        monkeypatch.setattr(torch.cuda, name, value)
    yield tmp_path


def _rows(out: Path, name: str, column: str = "ms") -> list[dict]:
    """The rows of out/NAME.csv, checked to hold a number in `column`: no failed measurement
    but those of a backend that refuses the CPU (SDPA's flash, cuDNN) or is not installed."""
    with (out / f"{name}.csv").open() as f:
        rows = list(csv.DictReader(f))
    excused = (common.UNSUPPORTED, common.NOT_AVAILABLE)
    failed = [r for r in rows if not _is_number(r[column]) and r[column] not in excused]
    assert not failed, failed
    return rows


def _is_number(text: str) -> bool:
    try:
        return float(text) == float(text)
    except ValueError:
        return False


def test_kernels_cuda_path_runs(cuda_stand_ins, monkeypatch):
    for op in kernels.OPS:
        sizes = {"rope": (64, 256), "cross_entropy": (20, 50), kernels.LCE: (20, 16)}
        monkeypatch.setattr(op, "sizes", (sizes.get(op.name, (48, 40)),))
    monkeypatch.setattr(kernels, "VOCAB", 50)
    monkeypatch.setattr(kernels, "COPY_BYTES", 4096)
    assert kernels.main(["--quick", "--out", str(cuda_stand_ins)]) == 0
    rows = _rows(cuda_stand_ins, "kernels")
    assert {r["op"] for r in rows} == {op.name for op in kernels.OPS}
    assert all(float(r["rel err"]) < 0.02 for r in rows if r["impl"] != "liger")


def test_attention_cuda_path_runs(cuda_stand_ins, monkeypatch):
    shapes = [attention.Shape("bf16", 16, 2, 32), attention.Shape("fp32", 16, 1, 48)]
    monkeypatch.setattr(attention, "HIDDEN", 32)
    monkeypatch.setattr(attention, "plan", lambda args: [(shape, {}) for shape in shapes])
    assert attention.main(["--quick", "--out", str(cuda_stand_ins)]) == 0
    rows = _rows(cuda_stand_ins, "attention")
    fastlm_rows = [r for r in rows if r["impl"] in ("fastlm", attention.ATOMIC)]
    assert len(fastlm_rows) == 2 * (3 + 2) and all(float(r["rel err"]) < 0.02 for r in fastlm_rows)
    monkeypatch.setattr(attention, "_flex_attention", lambda: None)  # needs CUDA
    monkeypatch.setattr(
        attention, "document_lengths", lambda total: [total // 4, total - total // 4]
    )
    sizes = dict(VARLEN_TOTALS=(40, 64), HEADS=2, HEAD_DIM=16, WINDOW=8, WINDOW_SEQ=48)
    for name, value in sizes.items():
        monkeypatch.setattr(attention, name, value)
    assert attention.main(["--varlen", "--quick", "--out", str(cuda_stand_ins)]) == 0
    rows = _rows(cuda_stand_ins, "attention_varlen")
    assert {r["case"] for r in rows} == {"varlen causal", "causal window 8"}
    assert all(float(r["rel err"]) < 0.02 for r in rows)


def test_moe_cuda_path_runs(cuda_stand_ins, monkeypatch):
    """The GPU check's MoE step (--headline): a row per implementation in moe_headline.csv and
    its summary; one whose output is not the fp32 math's is "wrong" and not timed (here a
    stand-in for Liger's), one not installed says so."""
    monkeypatch.setattr(moe, "QWEN3_30B", dict(T=24, D=48, F=40, E=6, k=2))
    monkeypatch.setattr(moe, "_liger_forward", lambda x, *rest: lambda: x * 2)
    out = str(cuda_stand_ins)
    assert moe.main(["--headline", "--out", out, "--tokens", "24"]) == 0
    with (cuda_stand_ins / "moe_headline.csv").open() as f:
        rows = {r["implementation"]: r for r in csv.DictReader(f)}
    assert list(rows) == list(moe.SPEED_IMPLEMENTATIONS)
    for name in ("fastlm", "grouped_mm", "eager"):
        assert float(rows[name]["rel_error"]) < 0.02 and _is_number(rows[name]["fwd_bwd_ms"])
    assert rows["liger"]["fwd_ms"].startswith("wrong (rel error")
    if common.optional_module("sonicmoe.functional") is None:
        assert rows["sonicmoe"]["fwd_ms"] == moe.NOT_INSTALLED
    assert "| fastlm |" in (cuda_stand_ins / "moe_headline_summary.md").read_text()


def _agree(losses: list[float]) -> None:
    """Equal but for bf16 autocast's rounding."""
    assert max(losses) - min(losses) <= 1e-2 * abs(min(losses)), losses


def test_train_cuda_path_runs(cuda_stand_ins, monkeypatch):
    tiny = dict(vocab_size=256, d_model=32, num_heads=2, d_ff=64)
    monkeypatch.setattr(train, "GPT2", train.GPT2 | tiny)
    steps = ["--steps", "1", "--warmup-steps", "1", "--out", str(cuda_stand_ins)]
    argv = ["--quick", "--seqs", "16", "--tokens", "32", "--layers", "1"]
    assert train.main([*argv, *steps]) == 0
    rows = _rows(cuda_stand_ins, "train", "ms/step")
    assert [r["impl"] for r in rows] == train.KINDS
    _agree([float(r["first loss"]) for r in rows])  # the same weights and data
    monkeypatch.setattr(train, "LLAMA3_LAYERS", TINY_LLAMA)
    monkeypatch.setattr(train, "HF_SHORTEST", 4)
    monkeypatch.setattr(train, "HF_LONGEST", 16)
    assert train.main(["--hf", "--quick", *steps]) == 0
    rows = [r for r in _rows(cuda_stand_ins, "train_hf", "ms/step") if r["impl"] != train.LIGER]
    assert len(rows) == 5
    _agree([float(r["first loss"]) for r in rows])
