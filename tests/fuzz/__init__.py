"""Fuzzing a live daemon through its untrusted inputs: IPC frames, gRPC messages, DHT datagrams.

Hypothesis generates MOSHPIT_FUZZ_EXAMPLES cases per input (default 2000; `make fuzz` runs
20000), from plain random bytes to well-formed messages with wrong, extreme or plausible field
values. Daemon 0 of a three-daemon swarm (no swarm key: every parser is exposed) takes them all;
each test module (tests/integration/test_fuzz_ipc.py, test_fuzz_grpc.py, test_fuzz_dht.py)
starts its own swarm.

After every case daemon 0 must be alive, and an IPC session must end promptly once the trainer
side hangs up. Every CHECK_EVERY cases and after each test:
  * its RSS stays below the RSS it had before fuzzing plus RSS_HEADROOM (200 MiB), and its
    open descriptors below the start plus FD_HEADROOM;
  * no daemon logged a traceback (a handler exception, a task that died);
  * well-formed traffic still works: `status` over IPC, the gRPC health service, an averaging
    round between daemons 0 and 1 (matchmaking goes through the DHT) giving the exact mean, and
    daemon 1 downloading the state daemon 0 published (DownloadState from another peer).
Daemon bugs the fuzzing found have regression tests after the fuzz tests of each module.
MOSHPIT_FUZZ_LOG_LEVEL=DEBUG makes the daemons' logs (under pytest's tmp_path) tell more when a
check fails.
"""
