"""The Hugging Face Hub: pushing models and Pythia-style step branches (`push`), and their model card (`card`).

Everything callers used from the former `neox_hf.hub` module is importable from here unchanged.
"""

from neox_hf.hub.card import (
    CARD_TAGS,
    architecture_table,
    data_table,
    evaluation_lines,
    fenced,
    human_count,
    model_card_body,
    with_legacy_rotary_keys,
    write_model_card,
)
from neox_hf.hub.push import (
    LOGIN_FIX,
    MAIN_BRANCH,
    HubPusher,
    add_push_arguments,
    call_with_retries,
    describe_failure,
    has_token,
    http_status,
    hub_error_for,
    is_run_folder,
    is_transient,
    model_folder_files,
    push_folder,
    redact_token,
    retry_command,
    run_push,
    step_revision,
)

__all__ = [
    "CARD_TAGS", "LOGIN_FIX", "MAIN_BRANCH", "HubPusher", "add_push_arguments", "architecture_table",
    "call_with_retries", "data_table", "describe_failure", "evaluation_lines", "fenced", "has_token", "http_status",
    "hub_error_for", "human_count", "is_run_folder", "is_transient", "model_card_body", "model_folder_files",
    "push_folder", "redact_token", "retry_command", "run_push", "step_revision", "with_legacy_rotary_keys",
    "write_model_card",
]
