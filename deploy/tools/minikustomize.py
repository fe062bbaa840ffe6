"""A small kustomize renderer, used by scripts/validate-manifests.sh only when
neither `kubectl kustomize` nor `kustomize` is on the machine.

It implements the subset of kustomize that deploy/ uses, and refuses anything
else instead of rendering it wrongly:
  resources (files and directories), namespace, labels (includeSelectors:
  false), configMapGenerator / secretGenerator (envs, literals, files; behavior
  create/merge/replace; options.disableNameSuffixHash; generatorOptions),
  images (newName/newTag/digest), patches (strategic merge, or JSON 6902 with a
  target), and rewriting of ConfigMap/Secret references to generated names.

Generated names get a 10-character content hash like kustomize's, but not the
same characters: the validator compares renderers with hashes masked.
"""

import base64
import copy
import hashlib
import json
import os
import re

import yaml

SUPPORTED_KEYS = {
    "apiVersion", "kind", "resources", "namespace", "labels", "configMapGenerator",
    "secretGenerator", "generatorOptions", "images", "patches",
}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass",
    "CustomResourceDefinition", "StorageClass", "PersistentVolume",
    "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "RuntimeClass",
}
# Strategic-merge list keys for the fields deploy/ patches.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "volumes": "name",
    "volumeMounts": "mountPath", "env": "name", "ports": "containerPort",
    "imagePullSecrets": "name",
}


class KustomizeError(Exception):
    pass


def _load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _hash_suffix(obj):
    enc = json.dumps({"kind": obj["kind"], "name": obj["metadata"]["name"],
                      "type": obj.get("type", ""), "data": obj.get("data", {})},
                     sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(enc.encode()).hexdigest()[:10]


def _parse_env_file(path):
    out = {}
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise KustomizeError("%s: line without '=': %r" % (path, line))
            k, v = line.split("=", 1)
            out[k] = v
    return out


def _generator_data(gen, base):
    data = {}
    for env in gen.get("envs", []) + ([gen["env"]] if "env" in gen else []):
        data.update(_parse_env_file(os.path.join(base, env)))
    for lit in gen.get("literals", []):
        if "=" not in lit:
            raise KustomizeError("literal without '=': %r" % lit)
        k, v = lit.split("=", 1)
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            v = v[1:-1]
        data[k] = v
    for spec in gen.get("files", []):
        key, _, fname = spec.partition("=")
        if not fname:
            key, fname = os.path.basename(spec), spec
        with open(os.path.join(base, fname)) as f:
            data[key] = f.read()
    extra = set(gen) - {"name", "namespace", "envs", "env", "literals", "files",
                        "behavior", "options", "type"}
    if extra:
        raise KustomizeError("generator %s: unsupported fields %s" % (gen.get("name"), sorted(extra)))
    return data


def _smp(dst, patch):
    """Strategic merge of patch into dst (both dicts), in place."""
    for k, v in patch.items():
        if v is None:
            dst.pop(k, None)
        elif isinstance(v, dict) and isinstance(dst.get(k), dict):
            _smp(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list) and k in MERGE_KEYS:
            key = MERGE_KEYS[k]
            for item in v:
                match = next((d for d in dst[k] if isinstance(d, dict) and d.get(key) == item.get(key)), None)
                if match is None:
                    dst[k].append(copy.deepcopy(item))
                else:
                    _smp(match, item)
        else:
            dst[k] = copy.deepcopy(v)


def _pointer(path):
    if not path.startswith("/"):
        raise KustomizeError("bad JSON pointer %r" % path)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _json6902(obj, ops):
    for op in ops:
        parts = _pointer(op["path"])
        parent = obj
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        kind = op["op"]
        if isinstance(parent, list):
            idx = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(idx, copy.deepcopy(op["value"]))
            elif kind == "remove":
                del parent[idx]
            elif kind == "replace":
                parent[idx] = copy.deepcopy(op["value"])
            else:
                raise KustomizeError("unsupported JSON patch op %r" % kind)
        else:
            if kind in ("add", "replace"):
                if kind == "replace" and last not in parent:
                    raise KustomizeError("replace of missing path %s" % op["path"])
                parent[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                if last not in parent:
                    raise KustomizeError("remove of missing path %s" % op["path"])
                del parent[last]
            else:
                raise KustomizeError("unsupported JSON patch op %r" % kind)


def _matches(obj, target):
    for field in ("kind", "name", "namespace"):
        if field in target:
            have = obj.get("kind") if field == "kind" else obj["metadata"].get(field)
            if not re.fullmatch(target[field], have or ""):
                return False
    extra = set(target) - {"kind", "name", "namespace", "group", "version"}
    if extra:
        raise KustomizeError("unsupported patch target fields %s" % sorted(extra))
    return True


def _rewrite_refs(obj, renames):
    """Point ConfigMap/Secret references at generated (hashed) names."""
    cms, secrets = renames.get("ConfigMap", {}), renames.get("Secret", {})

    def walk(node, parent_key=None):
        if isinstance(node, dict):
            if parent_key in ("configMapRef", "configMapKeyRef", "configMap") and node.get("name") in cms:
                node["name"] = cms[node["name"]]
            if parent_key in ("secretRef", "secretKeyRef") and node.get("name") in secrets:
                node["name"] = secrets[node["name"]]
            if parent_key == "secret" and node.get("secretName") in secrets:
                node["secretName"] = secrets[node["secretName"]]
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, parent_key)

    walk(obj.get("spec"))


def _images(obj, images):
    def walk(node):
        if isinstance(node, dict):
            for key in ("containers", "initContainers"):
                for c in node.get(key, []) if isinstance(node.get(key), list) else []:
                    img = c.get("image")
                    if not img:
                        continue
                    name, tag = img, None
                    if "@" in name:
                        name = name.split("@")[0]
                    elif ":" in name.rsplit("/", 1)[-1]:
                        name, tag = name.rsplit(":", 1)
                    for im in images:
                        if im["name"] != name:
                            continue
                        new = im.get("newName", name)
                        if "digest" in im:
                            c["image"] = "%s@%s" % (new, im["digest"])
                        else:
                            t = im.get("newTag", tag)
                            c["image"] = new if t is None else "%s:%s" % (new, t)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(obj)


def build(path):
    """Render the kustomization in directory path: a list of objects."""
    objs, _ = _build(os.path.abspath(path))
    for o in objs:
        o["metadata"].pop("__generated_base", None)
        o["metadata"].pop("__hash", None)
    return objs


def _build(path):
    kfile = os.path.join(path, "kustomization.yaml")
    if not os.path.exists(kfile):
        raise KustomizeError("%s: no kustomization.yaml" % path)
    with open(kfile) as f:
        k = yaml.safe_load(f) or {}
    extra = set(k) - SUPPORTED_KEYS
    if extra:
        raise KustomizeError("%s: unsupported kustomization fields %s" % (kfile, sorted(extra)))

    objs, renames = [], {"ConfigMap": {}, "Secret": {}}
    for res in k.get("resources", []):
        full = os.path.normpath(os.path.join(path, res))
        if os.path.isdir(full):
            sub, subren = _build(full)
            objs += sub
            for kind in renames:
                renames[kind].update(subren[kind])
        else:
            objs += _load_all(full)

    gen_opts = k.get("generatorOptions", {})
    for kind, field in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in k.get(field, []):
            data = _generator_data(gen, path)
            behavior = gen.get("behavior", "create")
            existing = next((o for o in objs if o["kind"] == kind and
                             o["metadata"].get("__generated_base", o["metadata"]["name"]) == gen["name"]), None)
            if behavior in ("merge", "replace"):
                if existing is None:
                    raise KustomizeError("%s %s: behavior %s but no such object" % (kind, gen["name"], behavior))
                obj = existing
                if behavior == "replace":
                    obj["data"] = {}
                obj.setdefault("data", {})
            elif behavior == "create":
                if existing is not None:
                    raise KustomizeError("%s %s already exists" % (kind, gen["name"]))
                obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]}, "data": {}}
                if kind == "Secret":
                    obj["type"] = gen.get("type", "Opaque")
                objs.append(obj)
            else:
                raise KustomizeError("unknown behavior %r" % behavior)
            if kind == "Secret":
                data = {kk: base64.b64encode(v.encode()).decode() for kk, v in data.items()}
            obj["data"].update(data)
            opts = dict(gen_opts, **gen.get("options", {}))
            if set(opts) - {"disableNameSuffixHash", "labels", "annotations"}:
                raise KustomizeError("unsupported generator options %s" % sorted(opts))
            obj["metadata"].setdefault("labels", {}).update(opts.get("labels", {}))
            if not obj["metadata"]["labels"]:
                del obj["metadata"]["labels"]
            if opts.get("annotations"):
                obj["metadata"].setdefault("annotations", {}).update(opts["annotations"])
            obj["metadata"]["__generated_base"] = gen["name"]
            obj["metadata"]["__hash"] = not opts.get("disableNameSuffixHash", False)

    for p in k.get("patches", []):
        if "path" in p:
            with open(os.path.join(path, p["path"])) as f:
                text = f.read()
        elif "patch" in p:
            text = p["patch"]
        else:
            raise KustomizeError("patch without path or patch")
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        target = p.get("target")
        if len(docs) == 1 and isinstance(docs[0], list):
            if not target:
                raise KustomizeError("JSON 6902 patch needs a target")
            hits = [o for o in objs if _matches(o, target)]
            if not hits:
                raise KustomizeError("patch target %s matched nothing" % target)
            for o in hits:
                _json6902(o, docs[0])
            continue
        for doc in docs:
            tgt = target or {"kind": doc["kind"], "name": doc["metadata"]["name"]}
            hits = [o for o in objs if _matches(o, tgt)]
            if not hits:
                raise KustomizeError("patch for %s matched nothing" % tgt)
            for o in hits:
                patch = copy.deepcopy(doc)
                patch.pop("apiVersion", None)
                patch.pop("kind", None)
                patch.get("metadata", {}).pop("name", None)
                patch.get("metadata", {}).pop("namespace", None)
                _smp(o, patch)

    if "namespace" in k:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]

    for entry in k.get("labels", []):
        if entry.get("includeSelectors") or entry.get("includeTemplates") or set(entry) - {"pairs", "includeSelectors"}:
            raise KustomizeError("labels: only pairs with includeSelectors: false are supported")
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(entry["pairs"])

    if k.get("images"):
        for o in objs:
            _images(o, k["images"])

    # Name generated objects (hash over final content), then fix references.
    for o in objs:
        md = o["metadata"]
        if "__generated_base" in md:
            base_name = md["__generated_base"]
            old_name = md["name"]
            md["name"] = base_name
            if md.get("__hash"):
                md["name"] = "%s-%s" % (base_name, _hash_suffix(o))
            renames[o["kind"]][base_name] = md["name"]
            renames[o["kind"]][old_name] = md["name"]
    for o in objs:
        _rewrite_refs(o, renames)
    return objs, renames
