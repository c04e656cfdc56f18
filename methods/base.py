"""Re-export of the plugin contract, which lives in the runtime (``specjax.method``)."""

from specjax.method import (  # noqa: F401
    Capabilities,
    Draft,
    Method,
    PrefillResult,
    ProposeContext,
    RuntimeInfo,
    VerifyResult,
    empty_draft,
)

__all__ = ["Capabilities", "Draft", "Method", "PrefillResult", "ProposeContext", "RuntimeInfo",
           "VerifyResult", "empty_draft"]
