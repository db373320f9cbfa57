"""Canonical append-only history: each prompt is the chain's exact token stream plus the new messages.

A coding agent sends its whole conversation every turn. Re-rendering and re-tokenizing it drifts
from what was sampled (templates drop reasoning, tool inputs come back re-serialised, BPE merges
differently across boundaries), and every drifted token is a sampled token we can no longer train.
Instead we keep the tokens the model actually saw and sampled, recognise the assistant messages the
client echoes back as our own outputs, and render only what is new (tool results, user text) plus
the generation prompt. Per-turn cost grows with the new tokens, not with the context.

Only a real history rewrite starts a new chain from a full render; the old chain is frozen as a
``wipe``. The plan's ``reason`` names the rewrite:

* ``first``: the thread's first request (or the first after :meth:`CanonicalHistory.freeze`);
* ``tools_changed``: the offered tools differ, e.g. the Codex CLI's compaction request (no tools) and the
  request after it (tools again, the history rewritten to its opening + the summary);
* ``compaction``: the conversation's opening (its first non-system message) was rewritten, e.g.
  Claude Code's "This session is being continued from a previous conversation...";
* ``fork``: the messages match a strict prefix of the chain's context (by the same rules as an
  extension: our assistant turns echoed) and then add only new user/tool messages; Claude Code's
  compaction request is one (the conversation up to an earlier point, then "write a summary");
* ``unmatched_assistant``: an echoed assistant message is not what we sampled;
* ``edited_history``: a later context message changed;
* ``removed_messages``: the request stops inside the chain's context, adding nothing;
* ``no_new_messages``: the request is exactly the chain's context;
* ``unsampled_assistant``: a new assistant message we never sampled (e.g. a prefill);
* ``window_check_failed``: the template did not render the new messages independently.

Usage (one :class:`CanonicalHistory` per agent thread: the main agent, each sub-agent)::

    plan = history.plan(messages, tools)          # no mutation; plan.prompt_ids goes to the engine
    turn = history.commit(plan, output_ids, output_logprobs, finish_reason, policy_version,
                          assistant_message)      # the message we parsed and sent back
"""

from rollbus.services.adapter.canonical.canonical_history import CanonicalHistory, TokenSlice
from rollbus.services.adapter.canonical.echo import (
    AssistantMessage,
    ToolDefaults,
    canonical_json,
    normalise_assistant,
    tool_defaults,
)
from rollbus.services.adapter.canonical.history import History, Message, PromptPlan, StalePlan
from rollbus.services.adapter.canonical.render import (
    WINDOW_MARKER,
    TemplateRenderer,
    WindowCheckFailed,
    default_stop_ids,
)
from rollbus.services.adapter.canonical.rerender_history import RerenderHistory

__all__ = [
    "WINDOW_MARKER", "AssistantMessage", "CanonicalHistory", "History", "Message", "PromptPlan",
    "RerenderHistory", "StalePlan", "TemplateRenderer", "TokenSlice", "ToolDefaults", "WindowCheckFailed",
    "canonical_json", "default_stop_ids", "normalise_assistant", "tool_defaults",
]  # fmt: skip
