"""The upstream facts this project depends on, recorded from local snapshots of the upstream repositories, and the
check that our fixtures and configs agree with that record (issue 37 §7; docs/upstream.md).

Each fact (:data:`FACTS`, the one explicit table) names an upstream repository, the ref it is read at, a path there,
how its value is extracted, and where **our** repository states the same thing (a constant, a file, a pattern) and how
the two must compare (``equal``; ``subset``: everything we use exists upstream; ``contains``: everything upstream
has, ours has). ``record`` writes every fact's
upstream value with the repository, the resolved commit and the path into one file, tests/fixtures/upstream-facts.json;
``check`` (and tests/test_upstream_facts.py, which needs neither the network nor the snapshots) compares our repository
with that file and prints one line per difference, naming the fact and both values.

Refresh, one command (snapshots as the fetch tool leaves them, ``<root>/<owner>+<name>/repo`` git directories, or
plain checkouts given one by one with ``--snapshot owner/name=PATH``)::

    .venv/bin/python tools/upstream_facts.py record --mirror-root /work/.mirror \\
        --snapshot llm-d/llm-d=<a checkout of llm-d/llm-d>@<its commit>

(``--snapshot`` overrides the mirror for one repository: the stored mirror of llm-d/llm-d is a 2025 snapshot without
the guides' image components, so the record of 2026-12-05 read that one file from a checkout of ec40068fbf0b), then
``.venv/bin/python tools/upstream_facts.py check`` (exit 1 on a difference) and commit the JSON file.

Snapshots are read with ``git show <commit>:<path>`` (a git directory) or from the working tree (a plain checkout,
whose commit is ``git rev-parse HEAD`` when it has one, else given as ``PATH@COMMIT``). Protos are compared as
compiled descriptors (grpcio-tools' protoc): packages, messages with field numbers, names, types and labels, enums,
services with their methods; comments and options do not count.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "fixtures" / "upstream-facts.json"

GIE = "kubernetes-sigs/gateway-api-inference-extension"
ROUTER = "llm-d/llm-d-router"
TIMESLICING = "llm-d-incubation/llm-d-rl-time-slicing"
LLM_D = "llm-d/llm-d"
GUIDE_VALUES = "manifests/guides/time-slicing/router"


@dataclass(frozen=True)
class Fact:
    """One upstream fact. ``extract``: (kind, args) of an upstream extractor (:data:`EXTRACTORS`), read at ``ref`` of
    ``repo`` from ``paths``; ``ours``: (kind, args) of a locator in our repository (:data:`LOCATORS`); ``compare``:
    ``equal``, ``subset`` (ours within upstream's: what we use exists there) or ``contains`` (upstream's within ours:
    what upstream has, ours has unchanged, and may add to)."""

    id: str
    repo: str
    ref: str
    paths: tuple[str, ...]
    extract: str
    ours: tuple[str, dict]
    compare: str = "equal"
    note: str = ""


FACTS: tuple[Fact, ...] = (
    Fact(
        "inferencepool.group-version",
        GIE,
        "main",
        ("config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",),
        "crd",
        ("file_names", {"glob": "manifests/crd-schemas/*_InferencePool_*.json", "pattern": r"(.+)_InferencePool_(.+)\.json"}),
        note="the InferencePool schema our manifests are validated against (manifests/crd-schemas/extract.py)",
    ),
    Fact(
        "inferenceobjective.legacy.group-version",
        GIE,
        "1e46715cf4e14ca7631f84a06c320ac21080008a",  # release-1.5: the API left main in #2973
        ("config/crd/bases/inference.networking.x-k8s.io_inferenceobjectives.yaml",),
        "crd",
        ("constants", {"file": "llmd_timeslice/domain/objectives.py", "names": ["LEGACY_GROUP", "VERSION"]}),
    ),
    Fact(
        "inferenceobjective.llm-d.group-version",
        ROUTER,
        "main",
        ("config/crd/bases/llm-d.ai_inferenceobjectives.yaml",),
        "crd",
        ("constants", {"file": "llmd_timeslice/domain/objectives.py", "names": ["LLMD_GROUP", "VERSION"]}),
        note="the group the EPP prefers (llm-d-router #1169), read first by the gate (epp_plugin/gate/objectives_discovery.py)",
    ),
    Fact(
        "router-chart.value-keys",
        ROUTER,
        "v0.10.0",
        ("config/charts",),
        "helm_value_keys",
        (
            "yaml_paths",
            {"files": [f"{GUIDE_VALUES}/values-{v}.yaml" for v in ("standalone", "gateway", "serving-label")]},
        ),
        compare="subset",
        note="every value key our router values set is one the charts define or their templates read (depth 3)",
    ),
    Fact(
        "epp.plugin-types",
        ROUTER,
        "v0.10.0",
        ("pkg",),
        "go_plugin_types",
        ("regex_all", {"file": "manifests/families/flow_control.py", "pattern": r'"type": "([a-z0-9-]+)"'}),
        compare="subset",
        note="every EPP plugin type our EndpointPickerConfigs name is registered by that EPP",
    ),
    Fact(
        "llm-d-guides.vllm-image-tag",
        LLM_D,
        "main",
        ("guides/recipes/modelserver/components/images/gpu-vllm/release/kustomization.yaml",),
        "kustomize_image_tag",
        (
            "regex_first",
            {"file": "manifests/guides/time-slicing/README.md", "pattern": r"the llm-d guides pin `(v[0-9][^`]*)`"},
        ),
        note="the vLLM image the llm-d guides' NVIDIA GPU model servers run (the component every guide includes)",
    ),
    Fact(
        "proto.snapshot-agent",
        TIMESLICING,
        "main",
        ("pkg/snapshot-agent/api/v1alpha1/snapshot_agent.proto",),
        "proto",
        ("proto", {"file": "llmd_timeslice/api/snapshot_agent/v1alpha1/snapshot_agent.proto"}),
        compare="contains",
        note="ours adds its extension fields (numbers 100 and up); every upstream element must be there unchanged",
    ),
    Fact(
        "proto.timeslice-orchestrator",
        TIMESLICING,
        "main",
        ("pkg/timeslice-orchestrator/api/v1alpha1/timeslice_orchestrator.proto",),
        "proto",
        ("proto", {"file": "llmd_timeslice/api/timeslice_orchestrator/v1alpha1/orchestrator.proto"}),
        compare="contains",
    ),
    Fact(
        "proto.timeslice-orchestrator.compat-copy",
        TIMESLICING,
        "main",
        ("pkg/timeslice-orchestrator/api/v1alpha1/timeslice_orchestrator.proto",),
        "proto",
        ("proto", {"file": "tests/compat/upstream_orchestrator.proto"}),
        note="the copy the compatibility test drives the orchestrator with, as upstream's client would",
    ),
)


class FactError(Exception):
    """A snapshot or one of our files cannot give a fact's value (one line, naming it)."""


# ------------------------------------------------------------------------------------------------ snapshots


@dataclass(frozen=True)
class Snapshot:
    """A local copy of one upstream repository. Without ``commit``: a git directory (bare, as the fetch tool leaves
    it, or a clone), read at each fact's ref with ``git show``. With ``commit``: a plain checkout of that commit, read
    from its files."""

    path: Path
    commit: str | None = None

    def _git(self, *args: str) -> subprocess.CompletedProcess:
        git_dir = self.path / ".git" if (self.path / ".git").exists() else self.path
        return subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True, text=True)

    def resolve(self, ref: str) -> str:
        """The commit ``ref`` names (a plain checkout: its own commit)."""
        if self.commit:
            return self.commit
        for candidate in (ref, f"refs/tags/{ref}", f"refs/heads/{ref}", f"origin/{ref}"):
            r = self._git("rev-parse", "--verify", "-q", f"{candidate}^{{commit}}")
            if r.returncode == 0:
                return r.stdout.strip()
        raise FactError(f"{self.path}: no ref {ref!r} (a plain checkout needs owner/name=PATH@COMMIT)")

    def read(self, commit: str, path: str) -> str:
        if self.commit:
            if not (self.path / path).is_file():
                raise FactError(f"{self.path}: no file {path}")
            return (self.path / path).read_text()
        r = self._git("show", f"{commit}:{path}")
        if r.returncode:
            raise FactError(f"{self.path}: no {path} at {commit[:12]}")
        return r.stdout

    def files(self, commit: str, directory: str) -> list[str]:
        if self.commit:
            return [str(p.relative_to(self.path)) for p in sorted((self.path / directory).rglob("*")) if p.is_file()]
        r = self._git("ls-tree", "-r", "--name-only", commit, "--", directory)
        if r.returncode:
            raise FactError(f"{self.path}: cannot list {directory} at {commit[:12]}")
        return [p for p in r.stdout.splitlines() if p]


# ----------------------------------------------------------------------------------------- upstream values


def _crd(snap: Snapshot, commit: str, paths: tuple[str, ...]) -> str:
    """``<spec.group>/<served versions, comma-separated>`` of a CustomResourceDefinition."""
    doc = yaml.safe_load(snap.read(commit, paths[0]))
    spec = doc.get("spec") or {}
    versions = [v["name"] for v in spec.get("versions") or [] if v.get("served")]
    return f"{spec.get('group')}/{','.join(versions)}"


def yaml_key_paths(texts: list[str], depth: int = 3) -> list[str]:
    """The dotted key paths (at most ``depth`` keys deep) of the YAML mappings in ``texts``, sorted, deduplicated."""
    out: set[str] = set()

    def walk(node: Any, prefix: str, level: int) -> None:
        if not isinstance(node, dict) or level > depth:
            return
        for k, v in node.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            out.add(p)
            walk(v, p, level + 1)

    for text in texts:
        for doc in yaml.safe_load_all(text):
            walk(doc, "", 1)
    return sorted(out)


def _yaml_paths(snap: Snapshot, commit: str, paths: tuple[str, ...]) -> list[str]:
    return yaml_key_paths([snap.read(commit, p) for p in paths])


_VALUES_REF = re.compile(r"\.Values\.([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)")
#: Template variables standing for a values subtree: routerlib reads the proxy's values through ``$proxy``, the
#: ``llm-d-router.proxy`` helper (``.Values.router.proxy`` merged over its preset: ``templates/_helpers.tpl``).
_VALUES_VARIABLES = {"proxy": "router.proxy"}
_VARIABLE_REF = re.compile(r"\$(" + "|".join(_VALUES_VARIABLES) + r")\.([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)")


def _helm_value_keys(snap: Snapshot, commit: str, paths: tuple[str, ...], depth: int = 3) -> list[str]:
    """The value keys (dotted, at most ``depth`` deep) the charts under ``paths[0]`` define in a values.yaml or read
    in a template (``.Values.a.b.c`` and its prefixes). A library chart's values count under the alias its users
    give it (``routerlib`` -> ``router``, llm-d-router ``config/charts/llm-d-router-standalone/Chart.yaml``)."""
    keys: set[str] = set()
    for f in snap.files(commit, paths[0]):
        text = snap.read(commit, f)
        if f.endswith("/values.yaml"):
            found = yaml_key_paths([text], depth + 1)
            if "/routerlib/" in f:
                found = [f"router.{k}" for k in found]
            keys.update(k for k in found if k.count(".") < depth)
        elif "/templates/" in f:
            refs = _VALUES_REF.findall(text) + [f"{_VALUES_VARIABLES[v]}.{r}" for v, r in _VARIABLE_REF.findall(text)]
            for ref in refs:
                parts = ref.split(".")[:depth]
                keys.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(keys)


_GO_TYPE = re.compile(r'\w*Type\s*=\s*"([a-z0-9][a-z0-9-]*)"')


def _kustomize_image_tag(snap: Snapshot, commit: str, paths: tuple[str, ...]) -> str:
    """``newTag`` of the first ``images`` entry of a kustomization or Component."""
    images = (yaml.safe_load(snap.read(commit, paths[0])) or {}).get("images") or [{}]
    return str(images[0].get("newTag"))


def _go_plugin_types(snap: Snapshot, commit: str, paths: tuple[str, ...]) -> list[str]:
    """The plugin type names the EPP's Go sources declare (``...Type = "name"``), test files left out."""
    found: set[str] = set()
    for f in snap.files(commit, paths[0]):
        if f.endswith(".go") and not f.endswith("_test.go") and "/test" not in f:
            found.update(_GO_TYPE.findall(snap.read(commit, f)))
    return sorted(found)


def proto_signature(text: str, name: str = "x.proto") -> list[str]:
    """The wire shape of one .proto file, one line per element (module doc). Raises FactError when protoc fails."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_text(text)
        include = Path(protoc.__file__).parent / "_proto"
        out = Path(tmp) / "set.pb"
        rc = protoc.main(["protoc", f"-I{tmp}", f"-I{include}", f"--descriptor_set_out={out}", str(Path(tmp) / name)])
        if rc != 0 or not out.exists():
            raise FactError(f"protoc could not compile {name}")
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = [f for f in fds.file if f.name == name]
    types = descriptor_pb2.FieldDescriptorProto
    lines = [f"package {fd.package}"]

    def message(m: Any, prefix: str) -> None:
        full = f"{prefix}{m.name}"
        for f in m.field:
            kind = f.type_name.rsplit(".", 1)[-1] if f.type_name else types.Type.Name(f.type)[5:].lower()
            label = "repeated " if f.label == types.LABEL_REPEATED else ""
            oneof = f" (oneof {m.oneof_decl[f.oneof_index].name})" if f.HasField("oneof_index") else ""
            lines.append(f"message {full}: {f.number} {f.name} {label}{kind}{oneof}")
        if not m.field:
            lines.append(f"message {full}: (no fields)")
        for e in m.enum_type:
            enum(e, f"{full}.")
        for n in m.nested_type:
            if not n.options.map_entry:
                message(n, f"{full}.")

    def enum(e: Any, prefix: str) -> None:
        lines.extend(f"enum {prefix}{e.name}: {v.name} = {v.number}" for v in e.value)

    for m in fd.message_type:
        message(m, "")
    for e in fd.enum_type:
        enum(e, "")
    for s in fd.service:
        for m in s.method:
            req = ("stream " if m.client_streaming else "") + m.input_type.rsplit(".", 1)[-1]
            resp = ("stream " if m.server_streaming else "") + m.output_type.rsplit(".", 1)[-1]
            lines.append(f"rpc {s.name}.{m.name}({req}) returns ({resp})")
    return sorted(lines)


def _proto(snap: Snapshot, commit: str, paths: tuple[str, ...]) -> list[str]:
    return proto_signature(snap.read(commit, paths[0]), Path(paths[0]).name)


EXTRACTORS = {
    "kustomize_image_tag": _kustomize_image_tag,
    "crd": _crd,
    "yaml_paths": _yaml_paths,
    "helm_value_keys": _helm_value_keys,
    "go_plugin_types": _go_plugin_types,
    "proto": _proto,
}


# -------------------------------------------------------------------------------------------- our values


def _constants(root: Path, file: str, names: list[str]) -> str | None:
    """Module-level string constants ``names`` of ``file`` (read, not imported), joined by ``/``; None when one is
    not there."""
    values: dict[str, str] = {}
    for node in ast.parse((root / file).read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    values[t.id] = node.value.value
    if any(n not in values for n in names):
        return None
    return "/".join(values[n] for n in names)


def _file_names(root: Path, glob: str, pattern: str) -> str | None:
    """``group/version`` from the one file name ``glob`` matches, its two ``pattern`` groups joined by ``/``; None when
    none or several match."""
    found = sorted(root.glob(glob))
    m = re.fullmatch(pattern, found[0].name) if len(found) == 1 else None
    return "/".join(m.groups()) if m else None


def _our_yaml_paths(root: Path, files: list[str]) -> list[str]:
    return yaml_key_paths([(root / f).read_text() for f in files])


def _regex_all(root: Path, file: str, pattern: str) -> list[str]:
    return sorted(set(re.findall(pattern, (root / file).read_text())))


def _regex_first(root: Path, file: str, pattern: str) -> str | None:
    m = re.search(pattern, (root / file).read_text())
    return m[1] if m else None


def _our_proto(root: Path, file: str) -> list[str]:
    return proto_signature((root / file).read_text(), Path(file).name)


LOCATORS = {
    "regex_first": _regex_first,
    "constants": _constants,
    "file_names": _file_names,
    "yaml_paths": _our_yaml_paths,
    "regex_all": _regex_all,
    "proto": _our_proto,
}


def ours(locator: list | tuple, root: Path = ROOT) -> Any:
    """Our repository's value for a fact's ``ours`` locator (None: our repository does not state it)."""
    kind, args = locator
    try:
        return LOCATORS[kind](root, **args)
    except FileNotFoundError:
        return None


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, list) or len(value) <= 6 else f"[{len(value)} items]"


def difference(entry: dict, root: Path = ROOT) -> str | None:
    """One line naming the fact and both values when our repository disagrees with the recorded ``entry``; else
    None."""
    mine, theirs = ours(entry["ours"], root), entry["value"]
    args = entry["ours"][1]
    where = args.get("file") or args.get("glob") or ", ".join(args.get("files", []))
    head = f"{entry['id']}: upstream {entry['repo']}@{entry['commit'][:12]} {', '.join(entry['paths'])}"
    if mine is None:
        return f"{head} says {_show(theirs)}; ours ({where}) does not state it"
    if entry["compare"] == "subset":
        extra = sorted(set(mine) - set(theirs))
        return f"{head} lacks {json.dumps(extra)}, which ours ({where}) uses" if extra else None
    if entry["compare"] == "contains":
        lacking = sorted(set(theirs) - set(mine))
        return f"{head} has {json.dumps(lacking)}, which ours ({where}) lacks" if lacking else None
    if mine == theirs:
        return None
    if isinstance(mine, list) and isinstance(theirs, list):
        only_up, only_ours = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
        return f"{head} has {json.dumps(only_up)} where ours ({where}) has {json.dumps(only_ours)}"
    return f"{head} says {json.dumps(theirs)}; ours ({where}) says {json.dumps(mine)}"


def load_record(path: Path = RECORD) -> list[dict]:
    return json.loads(path.read_text())["facts"]


# ------------------------------------------------------------------------------------------------------ CLI

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0], no_args_is_help=True)


def _snapshots(mirror_root: Path | None, given: list[str]) -> dict[str, Snapshot]:
    out: dict[str, Snapshot] = {}
    if mirror_root is not None:
        for repo in {f.repo for f in FACTS}:
            d = mirror_root / repo.replace("/", "+") / "repo"
            if d.exists():
                out[repo] = Snapshot(d)
    for item in given:
        repo, sep, rest = item.partition("=")
        if not sep or "/" not in repo:
            raise typer.BadParameter(f"--snapshot {item!r}: expected owner/name=PATH[@COMMIT]")
        path, _, commit = rest.partition("@")
        if not Path(path).is_dir():
            raise typer.BadParameter(f"--snapshot {item!r}: {path} is not a directory")
        out[repo] = Snapshot(Path(path), commit or None)
    return out


@app.command()
def record(
    mirror_root: Annotated[
        Path | None, typer.Option(help="Directory of snapshots named <owner>+<name>/repo (the fetch tool's layout).")
    ] = None,
    snapshot: Annotated[
        list[str] | None, typer.Option(help="owner/name=PATH[@COMMIT]: one repository's snapshot (repeatable).")
    ] = None,
    out: Annotated[Path, typer.Option(help="The recorded file.")] = RECORD,
    only: Annotated[
        list[str] | None,
        typer.Option(help="Refresh only this fact id (repeatable); the others are kept as the recorded file has them."),
    ] = None,
) -> None:
    """Extract every fact from the snapshots and write the recorded file (each fact with repo, commit, path)."""
    unknown = sorted(set(only or []) - {f.id for f in FACTS})
    if unknown:
        typer.echo(f"no fact named {', '.join(unknown)} (`list` names them)", err=True)
        raise typer.Exit(2)
    kept = {e["id"]: e for e in load_record(out)} if only and out.exists() else {}
    wanted = [f for f in FACTS if not only or f.id in only or f.id not in kept]
    snaps = _snapshots(mirror_root, snapshot or [])
    missing = sorted({f.repo for f in wanted} - set(snaps))
    if missing:
        typer.echo(f"no snapshot of {', '.join(missing)} (--mirror-root or --snapshot)", err=True)
        raise typer.Exit(2)
    entries = []
    for f in FACTS:
        if only and f.id not in only and f.id in kept:
            entries.append(kept[f.id])
            continue
        snap = snaps[f.repo]
        try:
            commit = snap.resolve(f.ref)
            value = EXTRACTORS[f.extract](snap, commit, f.paths)
        except FactError as exc:
            typer.echo(f"{f.id}: {exc}", err=True)
            raise typer.Exit(2) from None
        entries.append(
            {
                "id": f.id,
                "repo": f.repo,
                "ref": f.ref,
                "commit": commit,
                "paths": list(f.paths),
                "extract": f.extract,
                "value": value,
                "ours": [f.ours[0], f.ours[1]],
                "compare": f.compare,
                "note": f.note,
            }
        )
    out.write_text(json.dumps({"tool": "tools/upstream_facts.py record", "facts": entries}, indent=1) + "\n")
    typer.echo(f"{len(entries)} facts written to {out}")


@app.command()
def check(
    recorded: Annotated[Path, typer.Option(help="The recorded file.")] = RECORD,
) -> None:
    """Compare our repository with the recorded file: one line per difference, exit 1 when there is one."""
    lines = [d for e in load_record(recorded) if (d := difference(e))]
    for line in lines:
        typer.echo(line)
    if lines:
        raise typer.Exit(1)
    typer.echo("our repository agrees with every recorded upstream fact")


@app.command(name="list")
def list_facts() -> None:
    """The facts, where upstream states each and where ours does."""
    for f in FACTS:
        typer.echo(f"{f.id}: {f.repo}@{f.ref} {', '.join(f.paths)} -> ours {f.ours[0]} {json.dumps(f.ours[1])}")


if __name__ == "__main__":
    sys.exit(app())
