"""Test infrastructure only: a ``vllm.general_plugins`` entry point that the real-server tests
put on ``PYTHONPATH`` (with this directory's ``kvbridge_vllm_serving_tests-0.dist-info``, which
is how ``importlib.metadata`` finds it without installing anything). vLLM runs it in each of
its processes. The connector needs none of it.

- **The damaged-KV control**: a request to the prefill whose ``kv_transfer_params`` carry
  ``"kvbridge_test_damage": true`` gets a room of the ``DAMAGE_ROOMS`` range (every other
  room is drawn below it on these test servers); the prefill's worker
  zeroes layer 0 of such a room's blocks just before it sends them. The prefill computed its
  token from intact KV; the decode receives layer 0 damaged, so its tokens must differ if the
  comparison means anything. In the concurrent flow the router names the room: one in the
  ``DAMAGE_ROOMS`` range has its layer-0 rows zeroed just before the prefill posts them.
- **A slow sender**: a request whose ``kv_transfer_params`` carry ``"kvbridge_test_slow":
  SECONDS`` gets a room of the ``SLOW_ROOMS`` range (its low 16 bits are the seconds); the prefill's
  worker holds such a room that long before it sends (and says so in its log), so an abort
  lands while the request waits for its KV.
"""

from __future__ import annotations

import secrets

DAMAGE_KEY = "kvbridge_test_damage"
DAMAGE_ROOMS = 2**62
SLOW_KEY = "kvbridge_test_slow"
SLOW_ROOMS = 2**62 + 2**61
# Each range is 2^40 rooms wide: a room drawn at random from 63 bits (the proxy's) falls in
# one about once in 8 million.
WIDTH = 2**40


def damaged(room: int) -> bool:
    return DAMAGE_ROOMS <= room < DAMAGE_ROOMS + WIDTH


def slow(room: int) -> bool:
    return SLOW_ROOMS <= room < SLOW_ROOMS + WIDTH

_installed = False


def register() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    import kvbridge
    from kvbridge_vllm import scheduler, worker

    finished = scheduler.SchedulerState.finished
    plain = lambda: secrets.randbits(62)  # noqa: E731 - below DAMAGE_ROOMS
    scheduler.new_room = plain

    def finished_marking_rooms(self, req_id, params, *args, **kwargs):
        if params and params.get(DAMAGE_KEY):
            scheduler.new_room = lambda: DAMAGE_ROOMS + secrets.randbits(40)
        elif params and params.get(SLOW_KEY):
            seconds = int(params[SLOW_KEY]) & 0xFFFF
            scheduler.new_room = lambda: SLOW_ROOMS + (secrets.randbits(24) << 16) + seconds
        else:
            return finished(self, req_id, params, *args, **kwargs)
        try:
            return finished(self, req_id, params, *args, **kwargs)
        finally:
            scheduler.new_room = plain

    scheduler.SchedulerState.finished = finished_marking_rooms

    register_caches = worker.Worker.register
    send_when_ready = worker.Worker._send_when_ready
    poll_send = worker.Worker._poll_send

    def register_keeping_layer0(self, kv_caches):
        self._test_layer0 = next(iter(kv_caches.values()))
        return register_caches(self, kv_caches)

    def send_when_ready_damaging_or_held(self, room):
        import logging
        import time

        send = room.job
        if slow(send.room):
            room.held_since = time.monotonic()  # handed over by _poll_send once the hold ends
            logging.getLogger("vllm.kvbridge").warning("test: holding room %d for %d s", send.room, send.room & 0xFFFF)
            return
        if damaged(send.room):
            self._test_layer0[list(send.block_ids)] = 0
            logging.getLogger("vllm.kvbridge").warning("test: zeroed layer 0 of room %d's blocks", send.room)
        return send_when_ready(self, room)

    def poll_send_holding(self, req_id, room):
        import time

        held = getattr(room, "held_since", None)
        if held is not None and not room.posted and time.monotonic() - held >= (room.job.room & 0xFFFF):
            send_when_ready(self, room)
        return poll_send(self, req_id, room)

    post = worker.Worker._post

    def post_damaging(self, part, end):
        if damaged(part.stream.room) and part.next == 0:
            self._test_layer0[list(part.pages)] = 0
            import logging

            logging.getLogger("vllm.kvbridge").warning("test: zeroed layer 0 of room %d's blocks", part.stream.room)
        return post(self, part, end)

    worker.Worker.register = register_keeping_layer0
    worker.Worker._send_when_ready = send_when_ready_damaging_or_held
    worker.Worker._poll_send = poll_send_holding
    worker.Worker._post = post_damaging
