"""A prefill server of DCP a in its own process, one manager per rank, that sends one request
(harness.reshard_pools) to whichever decode asks: ``python reshard_prefill.py PORT A B ROOM``.
Prints ``prefill: sent`` once every rank's sender is Success, then waits for stdin to close."""

import sys

import harness


def main(port: int, a: int, b: int, room: int) -> None:
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_parallel

    from kvbridge_sglang.example import classes

    args = harness.publish("prefill", port)
    cls = classes()
    server = cls["BOOTSTRAP_SERVER"]("127.0.0.1", port)
    prefills, _ = harness.reshard_pools(a, b)
    managers = []
    for r in range(a):
        get_parallel().override_permanently(**harness.ranks(tp=a, rank=r, dcp=a))
        kv_args = prefills[r].kv_args(harness.RESHARD_P, engine_rank=r)
        managers.append(cls["MANAGER"](kv_args, DisaggregationMode.PREFILL, args, True))
    senders = [cls["SENDER"](m, f"127.0.0.1:{port}", room) for m in managers]
    src_pages, _ = harness.reshard_pages(a, b)
    for s in senders:
        s.init(len(src_pages), aux_index=1)
    for r, s in enumerate(senders):
        harness.poll_until(s, {KVPoll.WaitingForInput}, f"prefill rank {r}: the decode's request")
    for s in senders:
        harness.send_in_two_chunks(s, a)
    for r, s in enumerate(senders):
        harness.poll_until(s, {KVPoll.Success}, f"prefill rank {r}")
    print("prefill: sent", flush=True)
    sys.stdin.read()
    server.close()


if __name__ == "__main__":
    main(*(int(v) for v in sys.argv[1:5]))
