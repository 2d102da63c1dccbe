"""The Hugging Face hub, seen from the harness: offline mode, a reachability probe, resolved commits, clear errors.

Datasets (``tasks/``) and models (:mod:`vase.models`) both go through these helpers:

* :func:`ensure_hub_mode` — called before the first hub access of a process. Unless offline mode is already on
  (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``), it probes the hub endpoint once (``VASE_HUB_PROBE_TIMEOUT``
  seconds, default 3) and, when nothing answers, turns the hub libraries' offline mode on for the rest of the process.
  Without it, a shell without the Makefile's offline flags spends ~30 s in ``huggingface_hub``'s retries before the
  same error. ``VASE_HUB_PROBE=0`` skips the probe. Only "nothing answered" (DNS failure, refused connection,
  timeout) counts as unreachable: any HTTP answer, even an error, or a TLS failure means the network works, and the
  libraries then report what is wrong themselves.
* :func:`snapshot_sha` — the commit a downloaded file belongs to, read from its path in the hub cache
  (``.../snapshots/<commit>/<file>``): what was actually loaded, not the requested revision string.
* :func:`hub_error` — one line for a failed hub access: gated or unauthorised (accept the terms, set ``HF_TOKEN``),
  missing repository or revision, or unreachable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import ssl
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_PROBE_TIMEOUT_S = 3.0
OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = ("1", "ON", "YES", "TRUE")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")

_unset = object()
_probe_result: object = _unset  # None: reachable; str: why not (cached for the process)
_probe_lock = threading.Lock()


def hf_offline() -> bool:
    """Whether ``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to a true value."""
    return any(os.environ.get(k, "").strip().upper() in _TRUE for k in OFFLINE_FLAGS)


def endpoint() -> str:
    """The hub endpoint the libraries use: ``HF_ENDPOINT`` or ``https://huggingface.co``."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def is_commit_sha(revision: str | None) -> bool:
    """Whether ``revision`` is a full 40-hex commit sha (not a branch, a tag or a short sha)."""
    return bool(revision) and bool(_COMMIT_RE.match(str(revision)))


def revision_text(value: object, setting: str) -> str:
    """A revision setting as text; one-line ``ValueError`` if it is not one.

    Hydra reads an all-digit sha on the command line as an integer (converted back exactly); a sha such as
    ``7e12...`` that reads as a float has lost digits, so it must be quoted.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        raise ValueError(f"{setting}: {value!r} was read as a number; quote the sha: {setting}=\"'<sha>'\"")
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"{setting}: must be a commit sha (or a branch or tag), got {value!r}")


def probe(url: str, timeout_s: float) -> str | None:
    """``None`` if something answers at ``url`` within ``timeout_s`` seconds, else the reason (one line).

    An HTTP error status or a TLS failure counts as an answer (the network works). The request runs in a daemon
    thread, so a hanging DNS lookup cannot hold the caller longer than the timeout.
    """
    result: list[str | None] = []

    def attempt() -> None:
        try:
            req = urllib.request.Request(url, method="HEAD", headers={"User-Agent": "vase-hub-probe"})
            with urllib.request.urlopen(req, timeout=timeout_s):
                pass
            result.append(None)
        except urllib.error.HTTPError:
            result.append(None)  # the server answered
        except urllib.error.URLError as err:
            reason = err.reason
            if isinstance(reason, ssl.SSLError):
                result.append(None)  # something answered; a TLS problem is the libraries' to report
            else:
                result.append(f"{type(reason).__name__}: {reason}")
        except ssl.SSLError:
            result.append(None)
        except TimeoutError:
            result.append(f"no answer within {timeout_s:g} s")
        except OSError as err:
            result.append(f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=attempt, name="vase-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 0.5)
    if not result:
        return f"no answer within {timeout_s:g} s"
    return result[0]


def probe_timeout() -> float:
    """``VASE_HUB_PROBE_TIMEOUT`` (seconds, > 0) or the default 3 s."""
    raw = os.environ.get("VASE_HUB_PROBE_TIMEOUT", "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_PROBE_TIMEOUT_S
    except ValueError:
        raise ValueError(f"VASE_HUB_PROBE_TIMEOUT: must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"VASE_HUB_PROBE_TIMEOUT: must be > 0, got {raw!r}")
    return value


def set_offline() -> None:
    """Turn offline mode on for this process: the environment flags (also seen by child processes and by libraries
    imported later) and the flags that ``huggingface_hub`` and ``datasets`` read at import time."""
    for flag in OFFLINE_FLAGS:
        os.environ[flag] = "1"
    hub_constants = sys.modules.get("huggingface_hub.constants")
    if hub_constants is not None:
        hub_constants.HF_HUB_OFFLINE = True
    ds_config = sys.modules.get("datasets.config")
    if ds_config is not None:
        ds_config.HF_HUB_OFFLINE = True
        ds_config.HF_DATASETS_OFFLINE = True


def ensure_hub_mode() -> str | None:
    """``None`` when the hub may be used; else why not (offline flags, or the probe found it unreachable).

    The probe runs at most once per process; when it fails, offline mode is switched on (:func:`set_offline`), so
    every later hub access goes straight to the local caches. Also removes the duplicate console lines of the hub
    libraries (:func:`single_log_lines`).
    """
    global _probe_result
    single_log_lines()
    if hf_offline():
        return "offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
    if os.environ.get("VASE_HUB_PROBE", "1").strip().upper() in ("0", "OFF", "NO", "FALSE"):
        return None
    with _probe_lock:
        if _probe_result is _unset:
            url = endpoint()
            reason = probe(url, probe_timeout())
            if reason is not None:
                reason = f"{url} is unreachable ({reason})"
                logger.warning("hub: %s; hub libraries switched to offline mode (the local caches only)", reason)
                set_offline()
            _probe_result = reason
        result = _probe_result
    if result is None:
        return None
    if hf_offline():
        return str(result)
    return None  # the flags were cleared since (tests); trust the environment


def reset_probe() -> None:
    """Forget the probe's result (for tests)."""
    global _probe_result
    with _probe_lock:
        _probe_result = _unset


def single_log_lines() -> None:
    """Print each ``huggingface_hub`` / ``datasets`` log line once.

    Both libraries attach their own plain stderr handler and also propagate to the root logger; when the application
    has configured the root logger (Hydra's job logging), every warning appears twice. Their own handler is then
    removed, so their lines go through the application's handlers only (formatted, and into the run's log file).
    """
    root = logging.getLogger()
    if not root.handlers:
        return
    for name in ("huggingface_hub", "datasets"):
        lib = logging.getLogger(name)
        if not lib.propagate:
            continue
        for handler in list(lib.handlers):
            if type(handler) is logging.StreamHandler and handler.formatter is None:
                lib.removeHandler(handler)


def cache_root() -> Path:
    """The hub cache: ``HF_HUB_CACHE`` / ``HUGGINGFACE_HUB_CACHE`` or ``$HF_HOME/hub``."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return Path(os.environ.get("HF_HUB_CACHE", os.environ.get("HUGGINGFACE_HUB_CACHE", home / "hub")))


def snapshot_sha(path: str | Path) -> str | None:
    """The commit of a file downloaded into the hub cache (``.../snapshots/<commit>/...``), or ``None``."""
    parts = Path(path).parts
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "snapshots" and is_commit_sha(parts[i + 1]):
            return parts[i + 1]
    return None


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file's content, read in chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        out.append(cur)
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return out


def _status(exc: BaseException) -> int | None:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return int(status) if isinstance(status, int) else None


def classify(exc: BaseException) -> tuple[str, int | None]:
    """``(kind, http_status)`` of a failed hub access; kind is ``gated``, ``auth``, ``revision``, ``not_found``,
    ``unreachable`` or ``other``.

    Looks at the exception and its causes (``huggingface_hub``'s error classes and HTTP status), then at the
    messages ``datasets`` writes when it re-raises them without their cause (``"... is a gated dataset ..."``).
    """
    names = {cls.__name__ for e in _chain(exc) for cls in type(e).__mro__}
    status = next((s for s in map(_status, _chain(exc)) if s is not None), None)
    text = " ".join(str(e) for e in _chain(exc)).lower()
    if "GatedRepoError" in names or re.search(r"\bgated\b", text):
        return "gated", status
    if "RevisionNotFoundError" in names or re.search(r"revision .* (doesn't|does not) exist", text):
        return "revision", status
    if status in (401, 403) or "unauthorized" in text or "must be authenticated" in text:
        return "auth", status
    if "RepositoryNotFoundError" in names or "DatasetNotFoundError" in names or status == 404:
        return "not_found", status
    unreachable = ("OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "ConnectionError", "Timeout")
    if any(n in names for n in unreachable) or any(n.endswith("TimeoutException") for n in names):
        return "unreachable", status
    return "other", status


def hub_url(repo_id: str, repo_type: str = "model") -> str:
    """The repository's page on the hub."""
    return f"{endpoint()}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"


def hub_error(
    exc: BaseException, subject: str, repo_id: str, repo_type: str, revision: str | None, setting: str, fallback: str
) -> ValueError:
    """The one-line ``ValueError`` for a failed hub access.

    Args:
        exc: what the hub library raised.
        subject: who failed, e.g. ``"task gpqa_diamond: cannot load dataset Idavidrein/gpqa/gpqa_diamond"``.
        repo_id, repo_type: the repository (``"dataset"`` or ``"model"``).
        revision: the requested revision.
        setting: the setting that holds the revision (``"task.revision"``, ``"model.revision"``).
        fallback: what to do without the hub (e.g. ``"point task.data_dir at a local copy ..."``).
    """
    kind, status = classify(exc)
    http = f" (HTTP {status})" if status else ""
    url = hub_url(repo_id, repo_type)
    if kind in ("gated", "auth"):
        what = "is gated" if kind == "gated" else "needs authentication"
        return ValueError(
            f"{subject}: {repo_id} {what}{http}; accept its terms on {url} with your account and set HF_TOKEN to a "
            f"token of that account (or run `hf auth login`); or {fallback}"
        )
    if kind == "revision":
        return ValueError(f"{subject}: revision {revision!r} does not exist in {repo_id}{http}; check {setting}")
    if kind == "not_found":
        return ValueError(
            f"{subject}: {repo_id} was not found on the hub{http} ({url}); check the id, or if it is private set "
            f"HF_TOKEN; or {fallback}"
        )
    reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    if kind == "unreachable":
        return ValueError(f"{subject} (offline or unreachable: {reason}); {fallback}")
    return ValueError(f"{subject} ({reason}); {fallback}")
