#!/usr/bin/env python3
"""The checks of deploy/container_test.sh that need a gRPC client or parse
what the containers wrote: session affinity through the load balancer, a
replica killed and restarted on its state volume, Prometheus's view, and a
session kept across `docker stop` / `docker start`.

  container_check.py probe_keys LB_ADDR COUNT      # GetServerInfo once per candidate key
  container_check.py pick_keys LB_LOG COUNT OUT     # keys covering every replica, from the probe
  container_check.py affinity LOG_DIR BENCH_JSON
  container_check.py prometheus PROM_URL EXPECTED_CALLS
  container_check.py failover LB_ADDR te-1=HOST:PORT,... KILL_CMD START_CMD OUT_JSON
  container_check.py hold ADDR STATE_JSON       # a session for the SIGTERM check
  container_check.py resume ADDR STATE_JSON     # the same session, after a restart

Each prints one "PASS: ..." or "FAIL: ..." line per check and exits 1 when
one failed. The te_client package (client/python) must be importable, with
its stubs generated (TE_CLIENT_STUBS_DIR).
"""
import collections
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

failures = []


def check(ok, what):
    print(("PASS: " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def done():
    sys.exit(1 if failures else 0)


# ---- affinity: replicas' logs, the balancer's log, te_bench's report --------------

SESSION_LINE = re.compile(r"session=([0-9a-f]+)")
CREATED_LINE = re.compile(r'session=([0-9a-f]+) msg="created')
LB_LINE = re.compile(r"lb key=(\S+) replica=(\S+) .*uri=/te\.v1\.TeService/(\w+) http=(\d+) grpc=(\S*)")


PROBE_KEY = "ct-probe-%03d"


def probe_keys(lb, count):
    """One GetServerInfo through the balancer per candidate affinity key, so
    the balancer's log says which replica each key hashes to. No session is
    made: the replicas' session counts stay te_bench's alone."""
    c = te()
    stub = direct_stub(lb)
    for i in range(int(count)):
        stub.GetServerInfo(c.service_pb2.GetServerInfoRequest(), timeout=10,
                           metadata=[("x-te-session", PROBE_KEY % i)])


def pick_keys(lb_log, count, out):
    """te_bench's client keys, chosen so every replica gets a session: the
    first probed key of each replica, then the other probed keys in order.
    The balancer's hash of a key is fixed by its upstream addresses, so the
    same keys are picked on every run: the spread is a property of the
    choice, not of chance."""
    count = int(count)
    replica_of_key = {}
    for line in open(lb_log, errors="replace"):
        m = LB_LINE.search(line)
        if m and m.group(1).startswith("ct-probe-") and m.group(3) == "GetServerInfo":
            replica_of_key.setdefault(m.group(1), m.group(2))
    keys = sorted(replica_of_key)
    first = {}
    for key in keys:
        first.setdefault(replica_of_key[key], key)
    picked = sorted(first.values()) + [k for k in keys if k not in first.values()]
    picked = picked[:count]
    check(len(first) == 3 and len(picked) == count,
          "%d probed keys reach %d replicas (%s); %d picked" % (len(keys), len(first), sorted(first), len(picked)))
    with open(out, "w") as f:
        f.write(",".join(picked))


def affinity(log_dir, bench_json):
    bench = json.load(open(bench_json))
    point = bench["points"][0]
    check(point["clients"] == 16 and point["failed_calls"] == 0 and point["calls"] > 0,
          "te_bench through the balancer: %d clients, %d calls, %d failed"
          % (point["clients"], point["calls"], point["failed_calls"]))
    created = {}       # replica -> session ids it created
    mentioned = collections.defaultdict(set)   # session id -> replicas whose logs name it
    for replica in ("te-1", "te-2", "te-3"):
        text = open(os.path.join(log_dir, replica + ".log"), errors="replace").read()
        created[replica] = set(CREATED_LINE.findall(text))
        for sid in SESSION_LINE.findall(text):
            mentioned[sid].add(replica)
    counts = {r: len(ids) for r, ids in created.items()}
    total = sum(counts.values())
    check(total == 16, "16 sessions created in all: %s" % counts)
    check(all(n > 0 for n in counts.values()), "every replica holds sessions (load spread over all three)")
    strays = {sid: sorted(r) for sid, r in mentioned.items() if len(r) != 1}
    check(not strays, "each session id appears in one replica's log only (strays: %s)" % strays)
    # The balancer's own record: every affinity key went to one replica.
    replicas_of_key = collections.defaultdict(set)
    calls_of_replica = collections.Counter()
    bad = []
    for line in open(os.path.join(log_dir, "lb.log"), errors="replace"):
        m = LB_LINE.search(line)
        if not m or m.group(1) == "-" or m.group(1).startswith("ct-probe-") and m.group(3) == "GetServerInfo":
            continue  # no key, or the key probe before te_bench (pick_keys)
        key, replica, method, http, grpc_status = m.groups()
        replicas_of_key[key].add(replica)
        calls_of_replica[replica] += 1
        # nginx logs an unset variable as "-": the status is in the header
        # (trailers-only answers) or in the trailer.
        if http != "200" or grpc_status.replace("-", "") != "0":
            bad.append(line.strip())
    split = {k: sorted(r) for k, r in replicas_of_key.items() if len(r) != 1}
    check(len(replicas_of_key) == 16 and not split,
          "the balancer sent each of %d affinity keys to one replica (split: %s)" % (len(replicas_of_key), split))
    sessions_of_replica = collections.Counter(next(iter(r)) for r in replicas_of_key.values())
    check(dict(sessions_of_replica) == counts,
          "keys per replica in the balancer's log %s = sessions per replica in the replicas' logs"
          % dict(sessions_of_replica))
    check(not bad, "every proxied call answered grpc-status 0 (%d not: %s)" % (len(bad), bad[:3]))
    print(json.dumps({"sessions_per_replica": counts, "calls_per_replica": dict(calls_of_replica),
                      "bench_calls": point["calls"], "bench_calls_per_s": round(point["calls_per_s"], 1)}))


# ---- Prometheus's HTTP API -----------------------------------------------------------


def prom_query(url, expr):
    with urllib.request.urlopen(url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=5) as r:
        answer = json.load(r)
    if answer.get("status") != "success":
        raise RuntimeError(answer)
    return {s["metric"].get("instance", ""): float(s["value"][1]) for s in answer["data"]["result"]}


def prometheus(url, expected_calls):
    expected_calls = int(expected_calls)
    expr = 'sum by (instance) (te_rpc_requests_total{method="ForwardBackward",code="OK"})'
    deadline = time.time() + 30
    up, per_instance = {}, {}
    while time.time() < deadline:
        try:
            up = prom_query(url, 'up{job="te_server"}')
            per_instance = prom_query(url, expr)
        except (OSError, RuntimeError):
            pass
        if len(up) == 3 and sum(per_instance.values()) == expected_calls:
            break
        time.sleep(1)
    check(sorted(up) == ["te-1:9090", "te-2:9090", "te-3:9090"] and all(v == 1 for v in up.values()),
          "Prometheus scrapes all three replicas inside the compose network: up = %s" % up)
    check(sum(per_instance.values()) == expected_calls and len(per_instance) == 3
          and all(v > 0 for v in per_instance.values()),
          "Prometheus's ForwardBackward OK counts by replica %s sum to te_bench's %d calls"
          % ({k: int(v) for k, v in per_instance.items()}, expected_calls))


# ---- a session through te_client -------------------------------------------------------


def te():
    import te_client  # noqa: F401  (needs TE_CLIENT_STUBS_DIR)
    from te_client import client as client_lib
    return client_lib


def bf16_bytes(values):
    import numpy as np
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()


class Worker:
    """One session: a DelayedScaling DenseGeneral stepped with ForwardBackward
    on fixed x and dy (deterministic), so its FP8 state and accumulated
    gradients change with every step, the same way every time."""
    SHAPE = (2, 16, 32)

    def __init__(self, client, index):
        import numpy as np
        c = te()
        self.pb = c.service_pb2
        self.index = index
        self.session = client.session(recipes=[c.recipe_lib.DelayedScaling(amax_history_len=4)], policy="emulate")
        rng = np.random.default_rng(1000 + index)
        tensor = c.tensor_pb2.Tensor
        bf16 = c.tensor_pb2.BFLOAT16
        self.x = tensor(dtype=bf16, shape=self.SHAPE, inline_data=bf16_bytes(rng.standard_normal(self.SHAPE)))
        self.dy = tensor(dtype=bf16, shape=self.SHAPE[:2] + (48,),
                         inline_data=bf16_bytes(rng.standard_normal(self.SHAPE[:2] + (48,))))
        self.autocast = c.recipe_pb2.Autocast(enabled=True)
        spec = c.layers_pb2.LayerSpec(dense_general=c.layers_pb2.DenseGeneral(features=[48]))
        init = self.session.call("InitLayer", self.pb.InitLayerRequest(
            spec=spec, seed=7 + index, input_dtype=bf16, input_shape=self.SHAPE, autocast=self.autocast))
        self.layer = init.layer_id
        self.replica = None
        self.outcomes = []   # (seconds since the kill, code, message)

    def step(self):
        answer = self.session.call("ForwardBackward", self.pb.ForwardBackwardRequest(
            layer_id=self.layer, micro_batches=[self.pb.MicroBatch(x=self.x, dy=self.dy)],
            deterministic=True, autocast=self.autocast), timeout=30)
        return list(answer.values)

    def variables(self):
        answer = self.session.call("GetVariables", self.pb.GetVariablesRequest(layer_id=self.layer))
        return {(v.collection, v.path): (v.value.dtype, tuple(v.value.shape), v.value.inline_data)
                for v in answer.variables}


def direct_stub(address):
    import grpc
    c = te()
    return c.service_pb2_grpc.TeServiceStub(grpc.insecure_channel(address))


def replica_of(session, replicas):
    """The replica that holds `session`, asked of each replica directly (an
    unnumbered GetSessionInfo): exactly one may know it."""
    import grpc
    c = te()
    holders = []
    for name, address in replicas.items():
        try:
            direct_stub(address).GetSessionInfo(c.service_pb2.GetSessionInfoRequest(
                session=c.service_pb2.SessionRef(session_id=session.id, token=session._ref.token)), timeout=5)
            holders.append(name)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                holders.append(name + "?" + e.code().name)
    return holders


def wait_serving(address, seconds):
    import grpc
    c = te()
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            return direct_stub(address).GetServerInfo(c.service_pb2.GetServerInfoRequest(), timeout=2)
        except grpc.RpcError:
            time.sleep(0.5)
    return None


def failover(lb, replica_list, kill_cmd, start_cmd, out_json):
    c = te()
    replicas = dict(item.split("=", 1) for item in replica_list.split(","))
    client = c.connect(lb, pin_to_replica=False, rpc_timeout=60)
    workers = [Worker(client, i) for i in range(12)]
    for w in workers:
        holders = replica_of(w.session, replicas)
        w.replica = holders[0] if len(holders) == 1 else None
        check(len(holders) == 1, "session %s lives on one replica only: %s" % (w.session.id, holders))
    by_replica = collections.Counter(w.replica for w in workers)
    victim = by_replica.most_common(1)[0][0]
    killed = [w for w in workers if w.replica == victim]
    others = [w for w in workers if w.replica != victim]
    check(bool(others), "sessions on other replicas than %s: %s" % (victim, dict(by_replica)))

    # Three steps, a checkpoint, the state then, and one more step: what the
    # restored session must reproduce bit for bit.
    for w in workers:
        for _ in range(3):
            w.step()
        saved = w.session.call("Checkpoint", c.service_pb2.CheckpointRequest())
        w.checkpoint_bytes = saved.bytes
        w.at_checkpoint = w.variables()
        w.next_values = w.step()
        w.after_next = w.variables()

    # Every session steps in its own thread; the victim is killed (SIGKILL:
    # no drain, no save) in the middle.
    stop = threading.Event()
    kill_time = [None]

    def loop(w):
        while not stop.is_set():
            started = time.time()
            try:
                w.step()
                code, message = "OK", ""
            except c.errors.TeError as e:
                code, message = e.code.name, e.message
            when = None if kill_time[0] is None else started - kill_time[0]
            w.outcomes.append((when, code, message))
            if code != "OK":
                time.sleep(0.2)

    threads = [threading.Thread(target=loop, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    time.sleep(2)
    kill_time[0] = time.time()
    subprocess.run(shlex.split(kill_cmd.replace("{replica}", victim)), check=True, capture_output=True)
    # The kill command itself can take a while on a loaded machine, and the
    # replica answers until the signal lands: only calls started after the
    # command returned (plus a moment for the process to go) must fail.
    killed_after = time.time() - kill_time[0] + 0.5
    time.sleep(6)
    stop.set()
    for t in threads:
        t.join()

    seen = collections.Counter()
    messages = set()
    for w in killed:
        after = [o for o in w.outcomes if o[0] is not None and o[0] > killed_after]
        bad = [o for o in after if o[1] != "UNAVAILABLE" or victim not in o[2]]
        for o in after:
            seen[o[1]] += 1
            messages.add(o[2])
        check(after and not bad, "%s (on %s): %d calls after the kill, all UNAVAILABLE naming %s (others: %s)"
              % (w.session.id, victim, len(after), victim, bad[:2]))
    survivors_after = 0
    for w in others:
        after = [o for o in w.outcomes if o[0] is not None and o[0] > 0]
        failed = [o for o in w.outcomes if o[1] != "OK"]
        survivors_after += len(after)
        check(after and not failed, "%s (on %s): %d calls after the kill, all OK (failed: %s)"
              % (w.session.id, w.replica, len(after), failed[:2]))

    # Restarted on its volume: the checkpointed sessions come back.
    started = time.time()
    subprocess.run(shlex.split(start_cmd.replace("{replica}", victim)), check=True, capture_output=True)
    info = wait_serving(replicas[victim], 60)
    restart_s = time.time() - started
    check(info is not None and info.stats.sessions_restored == len(killed),
          "%s restarted in %.1f s and restored %s of its %d sessions from --state_dir"
          % (victim, restart_s, info.stats.sessions_restored if info else None, len(killed)))
    for w in killed:
        ok = True
        try:
            state = w.variables()
            ok = check(state == w.at_checkpoint,
                       "%s: same id and token; its %d variables are the checkpoint's, bit for bit"
                       % (w.session.id, len(state))) and ok
            values = w.step()
            ok = check(values == w.next_values and w.variables() == w.after_next,
                       "%s: the next step repeats the one made after the checkpoint, bit for bit (%r)"
                       % (w.session.id, values)) and ok
        except c.errors.TeError as e:
            check(False, "%s after the restart: %s %s" % (w.session.id, e.code.name, e.message))
    for w in others:
        try:
            w.step()
            check(True, "%s (on %s) steps on after the restart" % (w.session.id, w.replica))
        except c.errors.TeError as e:
            check(False, "%s (on %s) after the restart: %s %s" % (w.session.id, w.replica, e.code.name, e.message))
    for w in workers:
        w.session.close()
    summary = {
        "sessions_per_replica": dict(by_replica), "killed": victim, "killed_sessions": len(killed),
        "kill_command_s": round(killed_after - 0.5, 3),
        "killed_clients_saw": dict(seen), "killed_clients_messages": sorted(messages),
        "survivor_calls_during_kill": survivors_after, "survivor_failures": sum(
            1 for w in others for o in w.outcomes if o[1] != "OK"),
        "restart_to_serving_s": round(restart_s, 1),
        "checkpoint_bytes": [w.checkpoint_bytes for w in killed],
    }
    json.dump(summary, open(out_json, "w"), indent=1)
    print(json.dumps(summary))


# ---- one session across docker stop / docker start --------------------------------


def hold(address, state_json):
    c = te()
    client = c.connect(address, pin_to_replica=False, rpc_timeout=60)
    w = Worker(client, 99)
    w.session.detach()   # it must outlive this process: the server saves it at SIGTERM
    w.step()
    json.dump({"id": w.session.id, "token": w.session._ref.token, "layer": w.layer,
               "variables": {"%s/%s" % k: v[2].hex() for k, v in w.variables().items()}},
              open(state_json, "w"))
    check(True, "session %s open with a stepped layer on %s" % (w.session.id, address))


def resume(address, state_json):
    import grpc
    c = te()
    held = json.load(open(state_json))
    ref = c.service_pb2.SessionRef(session_id=held["id"], token=held["token"])
    try:
        answer = direct_stub(address).GetVariables(
            c.service_pb2.GetVariablesRequest(session=ref, layer_id=held["layer"]), timeout=10)
        got = {"%s/%s" % (v.collection, v.path): v.value.inline_data.hex() for v in answer.variables}
        check(got == held["variables"], "session %s came back after docker stop / start with its id, token and %d "
              "variables bit for bit" % (held["id"], len(got)))
        direct_stub(address).CloseSession(c.service_pb2.CloseSessionRequest(session=ref), timeout=10)
    except grpc.RpcError as e:
        check(False, "session %s after the restart: %s %s" % (held["id"], e.code().name, e.details()))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"probe_keys": probe_keys, "pick_keys": pick_keys, "affinity": affinity, "prometheus": prometheus,
     "failover": failover,
     "hold": hold, "resume": resume}[command](*args)
    done()
