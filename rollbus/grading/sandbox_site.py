"""The test sandbox's ``sitecustomize`` (shipped read-only to ``/eval/plugins``, first on ``PYTHONPATH``):
installs the grader's audit hook (:func:`rollbus_channel.install_audit`) when the interpreter starts, before
the repository's code is on ``sys.path``. Imports nothing of rollbus."""

import os

try:
    import rollbus_channel

    rollbus_channel.install_audit(os.environ.get("ROLLBUS_AUDIT_ROOT") or os.getcwd())
except Exception:  # the grade goes on; no audit record is then a fact the verdict does not rely on alone
    pass
