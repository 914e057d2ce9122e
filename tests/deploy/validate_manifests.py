"""Checks deploy/'s Dockerfile, compose file, Kubernetes manifests and Envoy
config: that every YAML parses, that the required fields are there, and that
the files agree with each other and with te_server (ports, flags, the health
service's name, the headless Service's DNS name, the Envoy config copy).

Each check returns a list of problems (empty when fine). The tests run them on
the real files, and on copies broken one way each, to show every check can
fail. Run under Bazel (//tests/deploy:validate_manifests) or directly:
    python3 tests/deploy/validate_manifests.py
"""

import copy
import os
import re
import shlex
import sys
import unittest

import yaml

NAMESPACE = "te"
HEADER = "x-te-session"


def repo_path(relative):
    """A repository file: from Bazel's runfiles under a test, else the checkout."""
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        candidate = os.path.join(srcdir, os.environ.get("TEST_WORKSPACE", "te_server"), relative)
        if os.path.exists(candidate):
            return candidate
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", relative)


def read(relative):
    with open(repo_path(relative), encoding="utf-8") as f:
        return f.read()


K8S_FILES = ["namespace.yaml", "te-server.yaml", "envoy.yaml", "kustomization.yaml"]


def load_all():
    """Everything the checks look at, parsed."""
    k8s = {}
    for name in K8S_FILES:
        k8s[name] = [d for d in yaml.safe_load_all(read("deploy/k8s/" + name)) if d is not None]
    return {
        "k8s": k8s,
        "compose": yaml.safe_load(read("deploy/compose.yaml")),
        "envoy_text": read("deploy/envoy/envoy.yaml"),
        "envoy": yaml.safe_load(read("deploy/envoy/envoy.yaml")),
        "dockerfile": read("deploy/Dockerfile"),
        "server_flags": defined_flags(read("server/main.cc") + read("server/metrics/flags.cc")),
        "probe_flags": defined_flags(read("deploy/health_probe_main.cc")),
        "service_name": health_service_name(read("server/main.cc")),
    }


# --- helpers ---------------------------------------------------------------


def defined_flags(source):
    return set(re.findall(r"ABSL_FLAG\(\s*[\w:<>]+\s*,\s*(\w+)\s*,", source))


def health_service_name(main_source):
    match = re.search(r'kServiceName\[\]\s*=\s*"([^"]+)"', main_source)
    return match.group(1) if match else None


def flags_of(args):
    """{name: value} of the --name=value arguments."""
    flags = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            flags[name] = value
    return flags


def objects(data, kind, name=None):
    found = []
    for docs in data["k8s"].values():
        for doc in docs:
            if doc.get("kind") == kind and (name is None or doc["metadata"]["name"] == name):
                found.append(doc)
    return found


def one(data, kind, name, problems):
    found = objects(data, kind, name)
    if len(found) != 1:
        problems.append(f"expected one {kind} {name}, found {len(found)}")
        return None
    return found[0]


def get(tree, *path):
    """tree[path[0]][path[1]]..., or None where a step is missing."""
    for step in path:
        try:
            tree = tree[step]
        except (KeyError, IndexError, TypeError):
            return None
    return tree


def container_ports(container):
    return {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}


def dockerfile_instructions(text):
    """[(INSTRUCTION, arguments)] with continuation lines joined."""
    joined, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        joined.append(pending + stripped)
        pending = ""
    result = []
    for line in joined:
        instruction, _, rest = line.partition(" ")
        result.append((instruction.upper(), rest.strip()))
    return result


def exec_form(arguments):
    try:
        value = yaml.safe_load(arguments)  # a JSON array is YAML too
    except yaml.YAMLError:
        return None
    return value if isinstance(value, list) else None


# --- checks ----------------------------------------------------------------


def check_k8s_basics(data):
    problems = []
    for file, docs in data["k8s"].items():
        if file == "kustomization.yaml":
            continue
        for doc in docs:
            for field in ("apiVersion", "kind"):
                if not doc.get(field):
                    problems.append(f"{file}: a document without {field}")
            name = get(doc, "metadata", "name")
            if not name:
                problems.append(f"{file}: a {doc.get('kind')} without metadata.name")
            if doc.get("kind") != "Namespace" and get(doc, "metadata", "namespace") != NAMESPACE:
                problems.append(f"{file}: {doc.get('kind')} {name} not in namespace {NAMESPACE}")
    listed = set(get(data["k8s"]["kustomization.yaml"][0], "resources") or [])
    wanted = set(K8S_FILES) - {"kustomization.yaml"}
    if listed != wanted:
        problems.append(f"kustomization.yaml lists {sorted(listed)}, not {sorted(wanted)}")
    return problems


def check_deployment(data):
    problems = []
    deployment = one(data, "Deployment", "te-server", problems)
    if deployment is None:
        return problems
    spec = deployment["spec"]
    pod_labels = get(spec, "template", "metadata", "labels") or {}
    selector = get(spec, "selector", "matchLabels") or {}
    if not selector or any(pod_labels.get(k) != v for k, v in selector.items()):
        problems.append("Deployment te-server: selector does not match the pod labels")
    pod = get(spec, "template", "spec") or {}
    containers = pod.get("containers") or []
    if len(containers) != 1:
        return problems + ["Deployment te-server: expected one container"]
    container = containers[0]
    flags = flags_of(container.get("args", []))
    for flag in flags:
        if flag not in data["server_flags"]:
            problems.append(f"Deployment te-server: --{flag} is not a te_server flag")
    ports = container_ports(container)
    grpc_port = int(flags.get("port", "50051"))
    if ports.get("grpc") != grpc_port:
        problems.append(f"Deployment te-server: containerPort grpc {ports.get('grpc')} != --port {grpc_port}")
    metrics_port = flags.get("metrics_port")
    if metrics_port is None or ports.get("metrics") != int(metrics_port):
        problems.append("Deployment te-server: containerPort metrics != --metrics_port")
    annotations = get(spec, "template", "metadata", "annotations") or {}
    if annotations.get("prometheus.io/port") != metrics_port:
        problems.append("Deployment te-server: prometheus.io/port != --metrics_port")

    resources = container.get("resources") or {}
    gpus = get(resources, "limits", "nvidia.com/gpu")
    if not isinstance(gpus, int) or gpus < 1:
        problems.append("Deployment te-server: no nvidia.com/gpu limit")
    for resource in ("cpu", "memory"):
        if not get(resources, "requests", resource):
            problems.append(f"Deployment te-server: no {resource} request")
    requested_gpus = get(resources, "requests", "nvidia.com/gpu")
    if requested_gpus is not None and requested_gpus != gpus:
        problems.append("Deployment te-server: GPU request differs from its limit")

    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        grpc = get(container, probe, "grpc")
        if grpc is None:
            problems.append(f"Deployment te-server: {probe} is not a grpc probe")
        elif grpc.get("port") != grpc_port:
            problems.append(f"Deployment te-server: {probe} port {grpc.get('port')} != {grpc_port}")
        elif grpc.get("service", "") not in ("", data["service_name"]):
            problems.append(f"Deployment te-server: {probe} asks about {grpc.get('service')}")

    security = pod.get("securityContext") or {}
    if security.get("runAsNonRoot") is not True or not security.get("runAsUser"):
        problems.append("Deployment te-server: not runAsNonRoot with a non-zero runAsUser")
    if get(container, "securityContext", "allowPrivilegeEscalation") is not False:
        problems.append("Deployment te-server: allowPrivilegeEscalation is not false")
    # te_server waits up to 10 s for calls in flight before it saves and exits.
    if (pod.get("terminationGracePeriodSeconds") or 30) <= 10:
        problems.append("Deployment te-server: terminationGracePeriodSeconds leaves no time to drain")
    return problems


def check_headless_service(data):
    problems = []
    service = one(data, "Service", "te-server-headless", problems)
    deployment = one(data, "Deployment", "te-server", problems)
    if service is None or deployment is None:
        return problems
    spec = service["spec"]
    if spec.get("clusterIP") != "None":
        problems.append("Service te-server-headless: clusterIP is not None (not headless)")
    pod_labels = get(deployment, "spec", "template", "metadata", "labels") or {}
    selector = spec.get("selector") or {}
    if not selector or any(pod_labels.get(k) != v for k, v in selector.items()):
        problems.append("Service te-server-headless: selector does not match te-server's pods")
    named = container_ports(deployment["spec"]["template"]["spec"]["containers"][0])
    for port in spec.get("ports") or []:
        target = port.get("targetPort")
        if target not in named and target not in named.values():
            problems.append(f"Service te-server-headless: targetPort {target} is no container port")
    if not any(p.get("name") == "grpc" for p in spec.get("ports") or []):
        problems.append("Service te-server-headless: no port named grpc")
    return problems


def check_envoy(data):
    problems = []
    envoy = data["envoy"]
    config_map = one(data, "ConfigMap", "te-envoy", problems)
    if config_map is not None and get(config_map, "data", "envoy.yaml") != data["envoy_text"]:
        problems.append("ConfigMap te-envoy differs from deploy/envoy/envoy.yaml")

    listeners = get(envoy, "static_resources", "listeners") or []
    routes = []
    for listener in listeners:
        for chain in listener.get("filter_chains", []):
            for f in chain.get("filters", []):
                for host in get(f, "typed_config", "route_config", "virtual_hosts") or []:
                    routes.extend(host.get("routes", []))
    if not routes:
        problems.append("envoy.yaml: no routes")
    for route in routes:
        action = route.get("route") or {}
        headers = [get(h, "header", "header_name") for h in action.get("hash_policy", [])]
        if HEADER not in headers:
            problems.append(f"envoy.yaml: a route without a hash_policy on {HEADER}")
        if action.get("timeout") not in ("0s", 0):
            problems.append("envoy.yaml: a route keeps a timeout (long calls would be cut)")

    clusters = {c["name"]: c for c in get(envoy, "static_resources", "clusters") or []}
    targets = {get(r, "route", "cluster") for r in routes}
    for target in targets:
        cluster = clusters.get(target)
        if cluster is None:
            problems.append(f"envoy.yaml: route to unknown cluster {target}")
            continue
        if cluster.get("lb_policy") != "RING_HASH":
            problems.append(f"envoy.yaml: cluster {target} is not RING_HASH")
        if cluster.get("type") != "STRICT_DNS":
            problems.append(f"envoy.yaml: cluster {target} does not resolve every pod (STRICT_DNS)")
        http2 = get(cluster, "typed_extension_protocol_options",
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config", "http2_protocol_options")
        if http2 is None:
            problems.append(f"envoy.yaml: cluster {target} does not speak HTTP/2 upstream")
        services = [get(h, "grpc_health_check", "service_name") for h in cluster.get("health_checks", [])]
        if data["service_name"] not in services:
            problems.append(f"envoy.yaml: cluster {target} does not health-check {data['service_name']}")
        service = one(data, "Service", "te-server-headless", problems)
        if service is not None:
            want_host = f"te-server-headless.{NAMESPACE}.svc.cluster.local"
            want_port = next((p["port"] for p in service["spec"]["ports"] if p.get("name") == "grpc"), None)
            for group in get(cluster, "load_assignment", "endpoints") or []:
                for endpoint in group.get("lb_endpoints", []):
                    address = get(endpoint, "endpoint", "address", "socket_address") or {}
                    if address.get("address") != want_host or address.get("port_value") != want_port:
                        problems.append(f"envoy.yaml: endpoint {address} is not {want_host}:{want_port}")

    deployment = one(data, "Deployment", "te-envoy", problems)
    envoy_service = one(data, "Service", "te-envoy", problems)
    if deployment is not None and listeners:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        listener_port = get(listeners[0], "address", "socket_address", "port_value")
        if container_ports(container).get("grpc") != listener_port:
            problems.append("Deployment te-envoy: containerPort grpc != the Envoy listener's port")
        args = container.get("args", [])
        config_path = args[args.index("-c") + 1] if "-c" in args else None
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        mount = mounts.get(os.path.dirname(config_path or ""))
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
        if mount is None or get(volumes.get(mount), "configMap", "name") != "te-envoy":
            problems.append("Deployment te-envoy: -c does not point into the te-envoy ConfigMap")
    if envoy_service is not None and deployment is not None:
        selector = envoy_service["spec"].get("selector") or {}
        labels = get(deployment, "spec", "template", "metadata", "labels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            problems.append("Service te-envoy: selector does not match te-envoy's pods")
    return problems


def check_compose(data):
    problems = []
    service = get(data["compose"], "services", "te-server")
    if service is None:
        return ["compose.yaml: no service te-server"]
    devices = get(service, "deploy", "resources", "reservations", "devices") or []
    if not any(d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or []) for d in devices):
        problems.append("compose.yaml: te-server reserves no NVIDIA GPU")
    flags = flags_of(service.get("command") or [])
    for flag in flags:
        if flag not in data["server_flags"]:
            problems.append(f"compose.yaml: --{flag} is not a te_server flag")
    published = {str(p).split(":")[-1] for p in service.get("ports") or []}
    for flag in ("port", "metrics_port"):
        if flag in flags and flags[flag] not in published:
            problems.append(f"compose.yaml: --{flag}={flags[flag]} is not a published port")
    build = service.get("build") or {}
    dockerfile = os.path.normpath(os.path.join("deploy", build.get("context", "."),
                                               build.get("dockerfile", "Dockerfile")))
    if dockerfile != os.path.join("deploy", "Dockerfile"):
        problems.append(f"compose.yaml: builds {dockerfile}, not deploy/Dockerfile")
    return problems


def check_dockerfile(data):
    problems = []
    instructions = dockerfile_instructions(data["dockerfile"])
    by_kind = {}
    for kind, arguments in instructions:
        by_kind.setdefault(kind, []).append(arguments)
    args = {}
    for arguments in by_kind.get("ARG", []):
        name, _, default = arguments.partition("=")
        args[name] = default
    base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), (by_kind.get("FROM") or [""])[-1])
    if not re.fullmatch(r"nvidia/cuda:\d+\.\d+(\.\d+)?-cudnn-runtime-ubuntu\d+\.\d+", base):
        problems.append(f"Dockerfile: base {base!r} is not an nvidia/cuda cudnn-runtime image")
    users = by_kind.get("USER") or []
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("Dockerfile: does not switch to a non-root USER")
    health = by_kind.get("HEALTHCHECK") or []
    if not health or "health_probe" not in health[-1]:
        problems.append("Dockerfile: no HEALTHCHECK running health_probe")
    entrypoint = exec_form((by_kind.get("ENTRYPOINT") or [""])[-1])
    if not entrypoint or not entrypoint[0].endswith("run.sh") or entrypoint[1:] != ["te_server"]:
        problems.append("Dockerfile: ENTRYPOINT is not [.../run.sh, te_server]")
    command = exec_form((by_kind.get("CMD") or [""])[-1]) or []
    flags = flags_of(command)
    for flag in flags:
        if flag not in data["server_flags"]:
            problems.append(f"Dockerfile: --{flag} is not a te_server flag")
    exposed = set(" ".join(by_kind.get("EXPOSE", [])).split())
    for flag in ("port", "metrics_port"):
        if flags.get(flag) not in exposed:
            problems.append(f"Dockerfile: --{flag}={flags.get(flag)} is not EXPOSEd")
    if health:
        command_line = health[-1].split("CMD", 1)[-1]
        probe_flags = flags_of(shlex.split(command_line.split("||")[0]))
        for flag in probe_flags:
            if flag not in data["probe_flags"]:
                problems.append(f"Dockerfile: HEALTHCHECK's --{flag} is not a health_probe flag")
        address = probe_flags.get("address", "127.0.0.1:50051")
        if address.rsplit(":", 1)[-1] != flags.get("port", "50051"):
            problems.append(f"Dockerfile: HEALTHCHECK probes {address}, not --port")
    return problems


CHECKS = [check_k8s_basics, check_deployment, check_headless_service, check_envoy,
          check_compose, check_dockerfile]


# --- tests -----------------------------------------------------------------


class RealFilesTest(unittest.TestCase):
    def test_every_check_passes(self):
        data = load_all()
        self.assertTrue(data["server_flags"] >= {"port", "host", "metrics_port"}, data["server_flags"])
        self.assertEqual(data["service_name"], "te.v1.TeService")
        for check in CHECKS:
            with self.subTest(check=check.__name__):
                self.assertEqual(check(data), [])


class BrokenCopiesTest(unittest.TestCase):
    """Each check, given a copy broken one way, names the problem."""

    def setUp(self):
        self.data = load_all()

    def broken(self, check, change, expected):
        data = copy.deepcopy(self.data)
        change(data)
        problems = check(data)
        self.assertTrue(any(expected in p for p in problems), f"{expected!r} not in {problems}")

    def container(self, data, name="te-server"):
        return objects(data, "Deployment", name)[0]["spec"]["template"]["spec"]["containers"][0]

    def test_missing_namespace(self):
        def change(data):
            del objects(data, "Service", "te-envoy")[0]["metadata"]["namespace"]
        self.broken(check_k8s_basics, change, "not in namespace")

    def test_kustomization_missing_a_file(self):
        def change(data):
            data["k8s"]["kustomization.yaml"][0]["resources"].remove("envoy.yaml")
        self.broken(check_k8s_basics, change, "kustomization.yaml lists")

    def test_no_gpu_limit(self):
        def change(data):
            del self.container(data)["resources"]["limits"]["nvidia.com/gpu"]
        self.broken(check_deployment, change, "no nvidia.com/gpu limit")

    def test_no_memory_request(self):
        def change(data):
            del self.container(data)["resources"]["requests"]["memory"]
        self.broken(check_deployment, change, "no memory request")

    def test_probe_on_the_wrong_port(self):
        def change(data):
            self.container(data)["readinessProbe"]["grpc"]["port"] = 9090
        self.broken(check_deployment, change, "readinessProbe port")

    def test_http_liveness_probe(self):
        def change(data):
            self.container(data)["livenessProbe"] = {"httpGet": {"port": 9090}}
        self.broken(check_deployment, change, "livenessProbe is not a grpc probe")

    def test_unknown_flag(self):
        def change(data):
            self.container(data)["args"].append("--no_such_flag=1")
        self.broken(check_deployment, change, "--no_such_flag is not a te_server flag")

    def test_port_flag_and_container_port_disagree(self):
        def change(data):
            self.container(data)["args"] = ["--port=6000" if a.startswith("--port=") else a
                                            for a in self.container(data)["args"]]
        self.broken(check_deployment, change, "!= --port 6000")

    def test_root_pod(self):
        def change(data):
            spec = objects(data, "Deployment", "te-server")[0]["spec"]["template"]["spec"]
            spec["securityContext"]["runAsNonRoot"] = False
        self.broken(check_deployment, change, "runAsNonRoot")

    def test_service_not_headless(self):
        def change(data):
            del objects(data, "Service", "te-server-headless")[0]["spec"]["clusterIP"]
        self.broken(check_headless_service, change, "not headless")

    def test_service_selects_other_pods(self):
        def change(data):
            objects(data, "Service", "te-server-headless")[0]["spec"]["selector"] = {"app": "x"}
        self.broken(check_headless_service, change, "selector does not match")

    def test_config_map_out_of_sync(self):
        def change(data):
            data["envoy_text"] += "# edited\n"
        self.broken(check_envoy, change, "differs from deploy/envoy/envoy.yaml")

    def test_hash_on_another_header(self):
        def change(data):
            route = data["envoy"]["static_resources"]["listeners"][0]["filter_chains"][0][
                "filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]
            route["route"]["hash_policy"] = [{"header": {"header_name": "x-other"}}]
        self.broken(check_envoy, change, "without a hash_policy on x-te-session")

    def test_round_robin(self):
        def change(data):
            data["envoy"]["static_resources"]["clusters"][0]["lb_policy"] = "ROUND_ROBIN"
        self.broken(check_envoy, change, "is not RING_HASH")

    def test_endpoint_not_the_headless_service(self):
        def change(data):
            endpoint = data["envoy"]["static_resources"]["clusters"][0]["load_assignment"][
                "endpoints"][0]["lb_endpoints"][0]["endpoint"]
            endpoint["address"]["socket_address"]["address"] = "te-server.te.svc.cluster.local"
        self.broken(check_envoy, change, "is not te-server-headless")

    def test_compose_without_gpu(self):
        def change(data):
            del data["compose"]["services"]["te-server"]["deploy"]
        self.broken(check_compose, change, "reserves no NVIDIA GPU")

    def test_compose_unpublished_metrics_port(self):
        def change(data):
            data["compose"]["services"]["te-server"]["ports"] = ["50051:50051"]
        self.broken(check_compose, change, "--metrics_port=9090 is not a published port")

    def test_dockerfile_runs_as_root(self):
        def change(data):
            data["dockerfile"] = data["dockerfile"].replace("USER te:te", "USER root")
        self.broken(check_dockerfile, change, "non-root USER")

    def test_dockerfile_without_healthcheck(self):
        def change(data):
            data["dockerfile"] = re.sub(r"HEALTHCHECK[^\n]*\\\n[^\n]*\n", "", data["dockerfile"])
        self.broken(check_dockerfile, change, "no HEALTHCHECK")

    def test_dockerfile_other_base(self):
        def change(data):
            data["dockerfile"] = data["dockerfile"].replace("cudnn-runtime", "devel")
        self.broken(check_dockerfile, change, "is not an nvidia/cuda cudnn-runtime image")

    def test_dockerfile_probe_flag_unknown(self):
        def change(data):
            data["probe_flags"] = data["probe_flags"] - {"quiet"}
        self.broken(check_dockerfile, change, "--quiet is not a health_probe flag")


if __name__ == "__main__":
    unittest.main(verbosity=2)
