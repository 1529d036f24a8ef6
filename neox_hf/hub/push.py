"""Push trained models and step checkpoints to the Hugging Face Hub.

`huggingface_hub` does the talking (`create_repo`, `create_branch`, `upload_folder`). This module
adds what a training run needs on top of it:

- the Pythia revision convention: the checkpoint of step N goes to branch `step{N}` (users load it
  with `from_pretrained(repo, revision="step1000")`), the final model to `main`;
- retries with backoff around the whole push: the client retries its upload calls but not
  `create_repo` / `create_branch`, and a run that trained for days should not lose its push to one
  503. Failures retrying cannot fix (401/403/404, bad request) become one `HubError` that names the
  repo and the fix, and never contains the token;
- `HubPusher`, a background uploader, so the training loop hands over a folder and keeps going, and deletes each
  local step folder once it is on the Hub;
- `model_folder_files`: a run's `output.dir` also holds checkpoints (optimizer states, RNG pickles), step copies
  and TensorBoard runs; only the model's own files are uploaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx2
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from neox_hf.errors import HubError
from neox_hf.checkpoint.run_log import RECIPE_NAME, RUN_STATE

logger = logging.getLogger(__name__)

MAIN_BRANCH = "main"
LOGIN_FIX = "run `hf auth login` (formerly `huggingface-cli login`) or set HF_TOKEN to a token with write access"

# 408/429 and 5xx are the Hub being busy or briefly down; anything else 4xx will fail the same way again.
_TRANSIENT_STATUS = {408, 429}
_MAX_BACKOFF_S = 60.0

T = TypeVar("T")


def step_revision(step: int) -> str:
    """The branch name of the checkpoint of `step` (Pythia convention: "step1000")."""
    if step < 0:
        raise HubError(f"step must be >= 0 to name a Hub branch, got {step}")
    return f"step{step}"


# ---------------------------------------------------------------------------------------------------------
# What of a run's folder is the model

# A run's output.dir is a model folder plus run state: checkpoints/ (optimizer states, RNG pickles), hub_steps/,
# runs/ (TensorBoard), train_log.jsonl, the lock. The model is its top-level weights, configs, tokenizer, card,
# recipe, and plots.
_MODEL_FILE_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "config.json", "generation_config.json",
    "adapter_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "README.md", RECIPE_NAME, "*.png", "*.svg",
)
_MODEL_SUBFOLDERS = ("plots",)


def model_folder_files(folder: str | os.PathLike) -> list[str]:
    """The relative paths of `folder` that belong on the Hub: the model's own files, not the run's state."""
    import fnmatch

    folder = Path(folder)
    files = [p.name for p in sorted(folder.iterdir())
             if p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in _MODEL_FILE_PATTERNS)]
    for sub in _MODEL_SUBFOLDERS:
        if (folder / sub).is_dir():
            files += [p.relative_to(folder).as_posix() for p in sorted((folder / sub).rglob("*")) if p.is_file()]
    return files


def is_run_folder(folder: str | os.PathLike) -> bool:
    """A training run's output.dir (it holds run state beside the model)."""
    folder = Path(folder)
    return any((folder / name).exists() for name in RUN_STATE)


def retry_command(folder: str | os.PathLike, repo_id: str, revision: str) -> str:
    """The `neox_hf push` command that redoes a failed push."""
    suffix = "" if revision == MAIN_BRANCH else f" --revision {revision}"
    return f"neox_hf push {folder} {repo_id}{suffix}"


def has_token(token: str | None = None) -> bool:
    """Whether a token is available without asking the network: explicit, HF_TOKEN, or `hf auth login`'s file."""
    from huggingface_hub import constants

    return bool(token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
                or Path(constants.HF_TOKEN_PATH).is_file())


# ---------------------------------------------------------------------------------------------------------
# One push, with retries


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    max_retries: int = 3,
    backoff_s: float = 2.0,
    exact: bool = False,
    endpoint: str | None = None,
    only: list[str] | None = None,
) -> str:
    """Upload every file of `folder` (or only the relative paths in `only`) to `repo_id` at branch `revision`
    (default `main`); return the commit URL.

    Creates the repo and the branch when missing (a new branch starts from `main`). With `exact=True`
    files on the branch that are not in `folder` are deleted, so the branch holds exactly this
    checkpoint (used for `step{N}` branches: a branch started from a populated `main` would otherwise
    keep main's README and stale weight shards). `endpoint` defaults to HF_ENDPOINT / huggingface.co.

    Transient failures (HTTP 5xx, 429, 408, connection errors) are retried `max_retries` times with
    exponential backoff starting at `backoff_s`; everything else raises `HubError` at once.
    """
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise HubError(f"cannot push {folder}: it is not a folder with files in it")
    if only is not None and not only:
        raise HubError(f"cannot push {folder}: it holds no model files (config.json, weights, tokenizer); "
                       "push the folder a training run or `neox_hf export` wrote")
    revision = revision or MAIN_BRANCH
    api = HfApi(endpoint=endpoint, token=token)

    def push_once() -> str:
        # Every step is idempotent (exist_ok, unchanged files are skipped), so a retry may redo them all.
        # private=None (not False) leaves a new repo at the owner's default visibility, as the Hub UI does.
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        if revision != MAIN_BRANCH:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            revision=revision,
            commit_message=commit_message or f"Upload {folder.name} with neox_hf",
            delete_patterns="*" if exact else None,
            allow_patterns=only,
        )
        return commit.commit_url

    target = f"'{repo_id}' (revision '{revision}')"
    return call_with_retries(push_once, target=target, token=token, max_retries=max_retries, backoff_s=backoff_s)


def call_with_retries(
    action: Callable[[], T], *, target: str, token: str | None, max_retries: int, backoff_s: float
) -> T:
    """Return `action()`, retrying transient Hub failures; raise `HubError` (token-free) otherwise."""
    for attempt in range(max_retries + 1):
        try:
            return action()
        except (HfHubHTTPError, httpx2.TransportError, ConnectionError, TimeoutError, ValueError) as err:
            # ValueError: the client's own refusals (bad repo id, invalid README.md metadata). Anything
            # else is a bug, not a Hub failure, and propagates untouched.
            if not is_transient(err):
                raise hub_error_for(err, target=target, token=token) from err
            if attempt == max_retries:
                reason = describe_failure(err, token)
                raise HubError(
                    f"pushing to {target} still failed after {attempt + 1} attempts ({reason}); "
                    "the Hub may be down: try again later"
                ) from err
            delay = min(backoff_s * 2**attempt, _MAX_BACKOFF_S)
            logger.warning(
                "push to %s failed (%s); retry %d/%d in %.1fs",
                target, describe_failure(err, token), attempt + 1, max_retries, delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # the loop always returns or raises


def is_transient(err: BaseException) -> bool:
    """Whether retrying the same request may succeed (Hub busy or down, network hiccup)."""
    if isinstance(err, OfflineModeIsEnabled):
        return False  # a ConnectionError subclass, but set on purpose by the user
    if isinstance(err, HfHubHTTPError):
        status = http_status(err)
        return status is not None and (status >= 500 or status in _TRANSIENT_STATUS)
    return isinstance(err, (httpx2.TransportError, ConnectionError, TimeoutError))


def http_status(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None)


def hub_error_for(err: BaseException, *, target: str, token: str | None) -> HubError:
    """A `HubError` for a failure retrying cannot fix, saying what to do about it."""
    if isinstance(err, OfflineModeIsEnabled):
        return HubError(f"cannot push to {target}: HF_HUB_OFFLINE is set; unset it to push")
    status = http_status(err)
    if status in (401, 403):
        return HubError(
            f"the Hub refused the push to {target} (HTTP {status}): the token is missing, invalid "
            f"or cannot write to this repo; {LOGIN_FIX}"
        )
    if status == 404:
        return HubError(
            f"the Hub could not find {target} (HTTP 404): check the repo id; for a private or "
            f"organization repo make sure your token can see it ({LOGIN_FIX})"
        )
    return HubError(f"pushing to {target} failed: {describe_failure(err, token)}")


def describe_failure(err: BaseException, token: str | None) -> str:
    """A one-line reason for `err`, with any token scrubbed out."""
    status = http_status(err)
    detail = getattr(err, "server_message", None) or next(iter(str(err).strip().splitlines()), "")
    text = f"HTTP {status}: {detail}" if status is not None else f"{type(err).__name__}: {detail}"
    return redact_token(text, token)


def redact_token(text: str, token: str | None) -> str:
    """`text` without the explicit token or the one in HF_TOKEN (defence in depth: no message we build
    contains a token, but server messages and exception texts are not ours)."""
    # Not huggingface_hub.get_token(): with HF_OIDC_RESOURCE set it performs a network token exchange.
    for secret in {token, os.environ.get("HF_TOKEN")}:
        if secret:
            text = text.replace(secret, "***")
    return text


# ---------------------------------------------------------------------------------------------------------
# Background pusher


@dataclass(frozen=True)
class _PushJob:
    folder: Path
    revision: str
    commit_message: str
    exact: bool
    only: list[str] | None = None  # relative paths to upload (None: the whole folder)
    delete_after: bool = False  # a local copy made only for the Hub (hub_steps/step{N}): removed once pushed


class HubPusher:
    """Uploads checkpoint folders from a worker thread, one at a time, in the order they were handed over.

    `push_step(folder, step)` returns at once; `wait()` blocks until everything queued is uploaded and
    re-raises the first failure; `close()` does the same and stops the worker. A failed push is logged
    when it happens and does not stop later pushes (a later checkpoint is still worth having).
    The folders must stay on disk until uploaded: call `wait()` before deleting or overwriting one. With
    `delete_after=True`, `push_step` deletes the step folder once its push succeeded (a failed one stays, and the
    failure names the `neox_hf push` command that retries it). `push_final` uploads only the model's own files.

    With `revision_per_step=True` (Pythia convention) step N goes to branch `step{N}`, holding exactly
    that checkpoint; with False every step overwrites `main`. `push_final` always goes to `main`.
    """

    def __init__(
        self,
        repo_id: str,
        *,
        private: bool = False,
        token: str | None = None,
        revision_per_step: bool = True,
        delete_after: bool = False,
        max_retries: int = 3,
        backoff_s: float = 2.0,
        endpoint: str | None = None,
    ):
        self.repo_id = repo_id
        self.revision_per_step = revision_per_step
        self.delete_after = delete_after
        self.commit_urls: list[str] = []  # in push order, for logging / tests
        self._push_kwargs = dict(
            private=private, token=token, max_retries=max_retries, backoff_s=backoff_s, endpoint=endpoint
        )
        self._jobs: queue.Queue[_PushJob | None] = queue.Queue()
        self._failures: list[BaseException] = []
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"hub-pusher:{repo_id}", daemon=True)
        self._worker.start()

    def push_step(self, folder: str | os.PathLike, step: int) -> None:
        """Queue the checkpoint of `step` for upload and return immediately."""
        revision = step_revision(step) if self.revision_per_step else MAIN_BRANCH
        self._submit(_PushJob(Path(folder), revision, f"Checkpoint at step {step}", exact=self.revision_per_step,
                              delete_after=self.delete_after))

    def push_final(self, folder: str | os.PathLike) -> None:
        """Queue the finished model (its own files: no checkpoints, step copies or logs) for upload to `main`."""
        self._submit(_PushJob(Path(folder), MAIN_BRANCH, "Final model", exact=False, only=model_folder_files(folder)))

    def wait(self) -> None:
        """Block until every queued push is done; raise the first failure since the last wait()."""
        self._jobs.join()
        self._raise_first_failure()

    def close(self) -> None:
        """Finish the queued pushes, stop the worker, and raise the first failure, if any."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._worker.join()
        self._raise_first_failure()

    def __enter__(self) -> HubPusher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            # Already unwinding from an error: still finish the uploads, but keep that error primary.
            try:
                self.close()
            except Exception:
                logger.exception("background Hub push failed while handling another error")

    def _submit(self, job: _PushJob) -> None:
        if self._closed:
            raise HubError(f"HubPusher for '{self.repo_id}' is closed; create a new one to push {job.folder}")
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                url = push_folder(
                    job.folder, self.repo_id, revision=job.revision, commit_message=job.commit_message,
                    exact=job.exact, only=job.only, **self._push_kwargs,
                )
                self.commit_urls.append(url)
                logger.info("pushed %s to %s@%s", job.folder, self.repo_id, job.revision)
                if job.delete_after:
                    shutil.rmtree(job.folder, ignore_errors=True)
            except Exception as err:  # kept for wait()/close(); the worker must survive to push the rest
                logger.error("background push of %s failed: %s", job.folder, err)
                self._failures.append(_with_retry_command(err, job, self.repo_id))
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _raise_first_failure(self) -> None:
        if not self._failures:
            return
        first, count = self._failures[0], len(self._failures)
        self._failures.clear()
        if count > 1:
            logger.error("%d background pushes to '%s' failed; raising the first", count, self.repo_id)
        raise first


def _with_retry_command(err: Exception, job: _PushJob, repo_id: str) -> Exception:
    """A HubError that also says how to redo this push by hand (the folder is still on disk)."""
    if not isinstance(err, HubError):
        return err
    command = retry_command(job.folder, repo_id, job.revision)
    retried = HubError(f"{err}; once fixed, retry with `{command}`")
    retried.__cause__ = err
    return retried


# ---------------------------------------------------------------------------------------------------------
# CLI: `neox_hf push OUT REPO_ID [--revision R]`


def add_push_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of `neox_hf push` to `parser`. The token comes from HF_TOKEN or `hf auth login`
    on purpose: a --token flag would show it in `ps` and in shell history."""
    parser.add_argument("folder", metavar="OUT", help="folder to upload (an exported model or a checkpoint)")
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repo, e.g. my-org/my-model (created if missing)")
    parser.add_argument("--revision", default=None, help="branch to push to, e.g. step1000 (default: main)")
    parser.add_argument("--private", action="store_true", help="create the repo as private if it does not exist")
    parser.add_argument("--commit-message", default=None, help="the commit's message (default: one naming the folder)")
    parser.add_argument("--max-retries", type=int, default=3, help="retries on transient Hub errors")
    parser.add_argument("--all-files", action="store_true",
                        help="upload everything in a run's folder, checkpoints and logs included (default: the model's files)")
    return parser


def run_push(args: argparse.Namespace) -> int:
    """Run `neox_hf push` from parsed arguments; print the commit URL and return the exit code.

    Refuses at once (not after retries) when no token is configured; a training run's folder uploads only the
    model's own files unless `--all-files`."""
    if not has_token():
        raise HubError(f"no Hugging Face token found, so the Hub would refuse the push to '{args.repo_id}'; {LOGIN_FIX}")
    if args.max_retries < 0:
        raise HubError(f"--max-retries must be >= 0, got {args.max_retries}")
    folder = Path(args.folder)
    only = model_folder_files(folder) if folder.is_dir() and is_run_folder(folder) and not args.all_files else None
    url = push_folder(
        folder,
        args.repo_id,
        revision=args.revision,
        private=args.private,
        commit_message=args.commit_message,
        max_retries=args.max_retries,
        only=only,
    )
    print(url)
    return 0
