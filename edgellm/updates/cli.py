"""CLI verbs of the store: `store list|add|activate|gc|repair`, `rollback`, `publish`, `refresh-channel`, `update`,
`keygen`, `trust add|list|remove|pin`."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgellm.store.local import Refs


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_store_list(args: argparse.Namespace) -> int:
    from edgellm.store.local import Store

    store = Store()
    rows: list[dict[str, Any]] = []
    for name in store.names():
        refs = store.refs(name)
        versions = {v: store.get(name, v) for v in store.versions(name)}
        owners = Counter(h for sv in versions.values() for h in {e.sha256 for e in sv.files.values()})
        for v, sv in versions.items():
            shared = [e for e in sv.files.values() if owners[e.sha256] > 1]
            rows.append({"name": name, "version": v,
                         "state": "current" if v == refs.current else "previous" if v == refs.previous else "",
                         "files": len(sv.files), "bytes": sv.total_bytes, "shared_files": len(shared),
                         "shared_bytes": sum(e.size for e in shared),
                         "own_files": sorted(n for n, e in sv.files.items() if owners[e.sha256] == 1)})
    usage = store.usage()
    if args.json:
        print(json.dumps({"versions": rows, **usage}, indent=2))
        return 0
    if not rows:
        print(f"no stored models in {store.root}; add one with `edgellm store add FOLDER NAME@VERSION` "
              "or `edgellm update NAME --channel URL`")
        return 0
    header = ("NAME", "VERSION", "STATE", "SIZE", "FILES", "SHARED WITH OTHER VERSIONS")
    table = [header] + [(r["name"], r["version"], r["state"], _mib(r["bytes"]), str(r["files"]),
                         f"{r['shared_files']} files, {_mib(r['shared_bytes'])}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for r in rows:
        if r["shared_files"]:
            print(f"  {r['name']}@{r['version']} alone has: {', '.join(r['own_files']) or 'nothing'}")
    print(f"on disk: {usage['blobs']} files, {_mib(usage['blob_bytes'])} "
          f"(the versions hold {_mib(usage['logical_bytes'])}; shared files are stored once)")
    return 0


def cmd_store_add(args: argparse.Namespace) -> int:
    from edgellm.store.local import Store, StoreError, split_ref

    name, version = split_ref(args.ref)
    if version is None:
        raise StoreError(f"give the version too: {name}@VERSION")
    store = Store()
    sv = store.add_folder(Path(args.folder), name, version)
    _say(f"stored {name}@{version} ({len(sv.files)} files, {_mib(sv.total_bytes)})")
    if not args.no_activate:
        _report_refs(name, store.activate(name, version))
    return 0


def _report_refs(name: str, refs: Refs) -> None:
    print(f"{name}: current {refs.current}" + (f", previous {refs.previous}" if refs.previous else ""))


def cmd_store_activate(args: argparse.Namespace) -> int:
    from edgellm.store.local import Store

    _report_refs(args.name, Store().activate(args.name, args.version))
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from edgellm.store.local import Store

    _report_refs(args.name, Store().rollback(args.name))
    return 0


def cmd_store_gc(args: argparse.Namespace) -> int:
    from edgellm.store.local import Store

    pruned, removed, freed = Store().gc(prune=args.prune)
    for ref in pruned:
        print(f"removed version {ref}")
    print(f"removed {removed} unreferenced files, freed {_mib(freed)}")
    return 0


def cmd_store_repair(args: argparse.Namespace) -> int:
    from edgellm.updates.repair import repair

    repair(args.name, args.channel, progress=False if args.quiet else None, timeout_s=args.timeout)
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from edgellm.resolve import resolve_model
    from edgellm.store.channel import publish
    from edgellm.store.trust import generate_keypair

    key = Path(args.key)
    if args.new_key:
        _say(f"new key pair {key} (public: {generate_keypair(key)}); give {key}.pub to your users")
    folder = resolve_model(args.artifact, progress=not args.quiet)
    name = args.name or (args.artifact if Path(args.artifact).name == args.artifact else folder.name)
    name = name.partition("@")[0]
    release, written = publish(folder, Path(args.channel), name, args.version, key, min_edgellm=args.min_edgellm,
                               expires_days=args.expires)
    shared = release.total_bytes - written
    print(f"published {release.name}@{release.version} to {args.channel}: {len(release.files)} files, "
          f"{_mib(release.total_bytes)}" + (f"; {_mib(shared)} of it was already in the channel" if shared else ""))
    _say(_expiry_note(Path(args.channel)))
    return 0


def _expiry_note(channel: Path) -> str:
    payload = json.loads(json.loads((channel / "index.json").read_text(encoding="utf-8"))["signed"])
    return (f"the index (sequence {payload['sequence']}) expires at {payload['expires']}; "
            f"`edgellm refresh-channel --channel {channel} --key KEY` re-signs it before then")


def cmd_refresh_channel(args: argparse.Namespace) -> int:
    from edgellm.store.channel import refresh

    refresh(Path(args.channel), Path(args.key), expires_days=args.expires)
    print(_expiry_note(Path(args.channel)))
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    from edgellm.updates.update import update

    update(args.name, args.channel, version=args.version, canary=args.canary,
           gate=Path(args.gate) if args.gate else None, max_drop=args.max_drop,
           activate=not args.no_activate, progress=False if args.quiet else None, timeout_s=args.timeout)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from edgellm.store.trust import generate_keypair

    public = generate_keypair(Path(args.path))
    _say(f"private key: {args.path} (keep it secret); public key: {args.path}.pub")
    print(public)
    return 0


def cmd_trust(args: argparse.Namespace) -> int:
    from edgellm.store import trust

    if args.trust_command == "add":
        models = tuple(args.models) if args.models is not None else trust.EVERY_MODEL
        kid = trust.trust(trust.read_key_argument(args.key), args.comment or "", models)
        print(f"trusted key {kid} for models: {' '.join(models)}")
    elif args.trust_command == "remove":
        print(f"removed key {trust.distrust(args.key)}")
    elif args.trust_command == "pin":
        from edgellm.store.local import Store

        public = trust.read_key_argument(args.key)
        known = trust.trusted_keys().get(trust.key_id(public))
        if known is None or known.key != public or not known.allows(args.name):
            raise trust.SignatureError(f"key {trust.key_id(public)} is not trusted for {args.name}; "
                                       f"`edgellm trust add {public} --models {args.name}` first")
        Store().pin(args.name, public)
        print(f"{args.name}: pinned to key {trust.key_id(public)}")
    else:
        keys = trust.trusted_keys()
        if not keys:
            print("no trusted keys; `edgellm trust add KEY` adds a publisher's public key")
        for kid, k in sorted(keys.items()):
            print(f"{kid}  {k.key}  models {','.join(k.models)}  added {k.added or '?'}  {k.comment}".rstrip())
    return 0


def add_store_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register the store, release and trust verbs on the top-level subparsers."""
    def verb(parent: Any, name: str, help: str) -> argparse.ArgumentParser:
        return parent.add_parser(name, help=help, description=help, parents=[common])

    p = verb(sub, "store", "versioned model store: list, add, activate, gc (files shared between versions "
                           "are stored once)")
    ss = p.add_subparsers(dest="store_command", required=True, metavar="ACTION")
    q = verb(ss, "list", "names, versions, current/previous, size, and which files versions share")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_store_list)
    q = verb(ss, "add", "install an artifact folder as NAME@VERSION (verified first) and make it current")
    q.add_argument("folder", metavar="FOLDER")
    q.add_argument("ref", metavar="NAME@VERSION")
    q.add_argument("--no-activate", action="store_true", help="install without switching current")
    q.set_defaults(func=cmd_store_add)
    q = verb(ss, "activate", "make an installed version current (the old one becomes previous)")
    q.add_argument("name", metavar="NAME")
    q.add_argument("version", metavar="VERSION")
    q.set_defaults(func=cmd_store_activate)
    q = verb(ss, "gc", "delete files no version uses and partial downloads (never files of current or previous)")
    q.add_argument("--prune", action="store_true", help="also delete versions that are neither current nor previous")
    q.set_defaults(func=cmd_store_gc)

    q = verb(ss, "repair", "fetch again, from the channel, the files of NAME's versions that fail their sha256")
    q.add_argument("name", metavar="NAME")
    q.add_argument("--channel", default=None, metavar="URL_OR_DIR", help="default: the channel NAME came from")
    _timeout_flag(q)
    q.set_defaults(func=cmd_store_repair)

    p = verb(sub, "rollback", "switch NAME back to its previous version, instantly (nothing is downloaded)")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_rollback)

    p = verb(sub, "publish", "add an artifact to a release channel folder and sign its index")
    p.add_argument("artifact", metavar="ARTIFACT", help="an artifact folder, NAME or NAME@VERSION")
    p.add_argument("--channel", required=True, metavar="DIR", help="the channel folder (serve it with any web server)")
    p.add_argument("--version", required=True, metavar="V")
    p.add_argument("--key", required=True, metavar="PRIVATE_KEY", help="Ed25519 private key (PEM)")
    p.add_argument("--new-key", action="store_true", help="create the key pair at --key first")
    p.add_argument("--name", default=None, help="model name in the channel (default: the artifact's name)")
    p.add_argument("--min-edgellm", default=None, metavar="VERSION",
                   help="oldest edgellm that may install it (default: the one that compiled it)")
    _expires_flag(p)
    p.set_defaults(func=cmd_publish)

    p = verb(sub, "refresh-channel", "re-sign a channel's index with a new sequence and expiry, nothing else "
                                     "changed (run it before the index expires, e.g. from cron)")
    p.add_argument("--channel", required=True, metavar="DIR", help="the channel folder")
    p.add_argument("--key", required=True, metavar="PRIVATE_KEY", help="the key that signs the channel")
    _expires_flag(p)
    p.set_defaults(func=cmd_refresh_channel)

    p = verb(sub, "update", "install a model's newest signed release, downloading only the files not yet stored")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--channel", default=None, metavar="URL_OR_DIR", help="default: the channel NAME came from")
    p.add_argument("--version", default=None,
                   help="a specific version (default: the channel's latest); also the only way to move to a "
                        "version published before the current one")
    p.add_argument("--canary", default=None, metavar="PROMPT", help="generate a reply with the new version first")
    p.add_argument("--gate", default=None, metavar="REPORT",
                   help="`eval task --json` report of the current version; the new one must not drop more")
    p.add_argument("--max-drop", type=float, default=5.0, help="points a gated rate may drop (default 5)")
    p.add_argument("--no-activate", action="store_true", help="install, but keep the current version active")
    _timeout_flag(p)
    p.set_defaults(func=cmd_update)

    p = verb(sub, "keygen", "make an Ed25519 key pair for signing channels (PATH and PATH.pub)")
    p.add_argument("path", metavar="PATH")
    p.set_defaults(func=cmd_keygen)

    p = verb(sub, "trust", "public keys whose channels `edgellm update` accepts, and the models each may publish")
    ts = p.add_subparsers(dest="trust_command", required=True, metavar="ACTION")
    q = ts.add_parser("add", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
                      help="trust a public key (ed25519:BASE64, or a .pub file), for some or every model",
                      description="trust a public key (ed25519:BASE64, or a .pub file) to publish the models "
                                  "--models names (exact names or globs); adding a key again replaces its entry",
                      epilog="examples:\n"
                             "  edgellm trust add keys/release.key.pub --models smollm2 'qwen2.5-*'\n"
                             "  edgellm trust add ed25519:bqd9...= --models '*' --comment 'our release key'")
    q.add_argument("key", metavar="KEY")
    q.add_argument("--models", nargs="+", default=None, metavar="PATTERN",
                   help="model names or glob patterns this key may publish (default: every model, '*')")
    q.add_argument("--comment", default=None)
    q.set_defaults(func=cmd_trust)
    q = ts.add_parser("pin", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
                      help="pin an installed model to another trusted key (after its publisher changed keys)",
                      description="a model is pinned to the key that signed its first install from a channel; "
                                  "updates signed by any other key are refused until you pin the new one here",
                      epilog="example:\n  edgellm trust pin smollm2 keys/new-release.key.pub")
    q.add_argument("name", metavar="NAME")
    q.add_argument("key", metavar="KEY", help="the new key (ed25519:BASE64, or a .pub file); it must be trusted "
                                              "for NAME")
    q.set_defaults(func=cmd_trust)
    q = verb(ts, "list", "the trusted keys")
    q.set_defaults(func=cmd_trust)
    q = verb(ts, "remove", "stop trusting a key (its id or the key)")
    q.add_argument("key", metavar="KEY")
    q.set_defaults(func=cmd_trust)


def _timeout_flag(parser: argparse.ArgumentParser) -> None:
    from edgellm.store.channel import TIMEOUT_S

    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="SECONDS",
                        help=f"most time one channel read (the index, one file) may take in all, however slowly "
                             f"its bytes arrive (default {TIMEOUT_S:g}); a cut download resumes on the next run")


def _expires_flag(parser: argparse.ArgumentParser) -> None:
    from edgellm.store.channel import EXPIRES_DAYS

    parser.add_argument("--expires", type=float, default=EXPIRES_DAYS, metavar="DAYS",
                        help=f"days the signed index stays valid (default {EXPIRES_DAYS:g}); after that, updates "
                             "refuse it as a frozen channel until it is re-signed")
