"""The billing classes of issue 36, by name: cache tiers, P/D roles, modalities, service tiers.

The fields are defined in ``schemas/`` (RequestStarted, RequestFinished, RequestAccounting,
TokenSegment; schema v7); this module names what they hold and how one maps onto another, so that
the fold, the store, the prices and the exporters say the same word for the same thing.

Cache tiers (where a prompt position's KV came from when this request did not compute it):

====================  ===========================  =====================  ===============================
tier                  ``requests`` column          timeline status        read price class
====================  ===========================  =====================  ===============================
``gpu``               ``cache_read_tokens``        ``cached``             ``cached_input``
``cpu_offload``       ``cache_read_cpu_offload_``  ``cached_cpu_offload`` ``cached_input_cpu_offload``
``external``          ``external_kv_tokens``       ``external_kv``        ``cached_input_external``
``host``              ``cache_read_host_tokens``   ``cached_host``        ``cached_input_host``
``storage``           ``cache_read_storage_``      ``cached_storage``     ``cached_input_storage``
====================  ===========================  =====================  ===============================

``gpu`` is the engine's own prefix cache in accelerator memory. ``cpu_offload`` is a CPU tier of the
same engine fed by a KV connector (vLLM's ``OffloadingConnector``, LMCache's CPU tier). ``external``
is KV a connector brought from outside the engine: the decode side of prefill/decode disaggregation,
a remote store. ``host`` and ``storage`` are SGLang HiCache's L2 (host memory) and L3 (storage); a
vLLM connector's ``disk`` source is ``storage`` too. Each prompt position is in at most one tier (or
computed), so the tiers never bill one position twice.
"""

from __future__ import annotations

from collections.abc import Mapping

GPU, CPU_OFFLOAD, EXTERNAL, HOST, STORAGE = "gpu", "cpu_offload", "external", "host", "storage"

#: Every cache tier, nearest the accelerator first.
CACHE_TIERS = (GPU, CPU_OFFLOAD, EXTERNAL, HOST, STORAGE)

#: The RequestAccounting field (and ``requests`` column) that counts each tier's positions.
TIER_COLUMN = {
    GPU: "cache_read_tokens",
    CPU_OFFLOAD: "cache_read_cpu_offload_tokens",
    EXTERNAL: "external_kv_tokens",
    HOST: "cache_read_host_tokens",
    STORAGE: "cache_read_storage_tokens",
}

#: The TokenSegment status of a position each tier served.
TIER_STATUS = {
    GPU: "cached",
    CPU_OFFLOAD: "cached_cpu_offload",
    EXTERNAL: "external_kv",
    HOST: "cached_host",
    STORAGE: "cached_storage",
}
STATUS_TIER = {status: tier for tier, status in TIER_STATUS.items()}

#: The price class of a read from each tier (USD per 1M tokens; docs/cost-model.md says what an
#: unset one falls back to: cached_input for the engine's own tiers, nothing for ``external``).
TIER_PRICE_CLASS = {
    GPU: "cached_input",
    CPU_OFFLOAD: "cached_input_cpu_offload",
    EXTERNAL: "cached_input_external",
    HOST: "cached_input_host",
    STORAGE: "cached_input_storage",
}

#: Engine source names (RequestStarted.cached_tokens_by_source) to tiers, per engine kind.
#: vLLM: ``vllm.v1.metrics.cache_hit_source.CacheHitSource`` (device, host, p2p, disk,
#: external_unspecified); SGLang: ``cached_tokens_details`` (device, host, storage).
SOURCE_TIERS: Mapping[str, Mapping[str, str]] = {
    "vllm": {
        "device": GPU,
        "host": CPU_OFFLOAD,
        "disk": STORAGE,
        "p2p": EXTERNAL,
        "external_unspecified": EXTERNAL,
    },
    "sglang": {"device": GPU, "host": HOST, "storage": STORAGE},
}


def cache_tier(engine_kind: str, source: str) -> str:
    """The tier of an engine's cache-hit ``source``; a source the engine kind does not name is
    ``external`` (KV from outside what this engine holds itself)."""
    return SOURCE_TIERS.get(engine_kind, SOURCE_TIERS["vllm"]).get(source, EXTERNAL)


# Prefill/decode disaggregation (RequestStarted.pd_role, RequestAccounting.pd_role).
PD_PREFILL, PD_DECODE, PD_NONE = "prefill", "decode", "none"
PD_ROLES = (PD_PREFILL, PD_DECODE, PD_NONE)

# Multimodal prompt items (MmInput.modality): each has its token count, its not-computed part and
# its input price class.
MODALITIES = ("image", "audio", "video")
MODALITY_COLUMN = {m: f"{m}_tokens" for m in MODALITIES}
MODALITY_CACHED_COLUMN = {m: f"{m}_cached_tokens" for m in MODALITIES}
MODALITY_PRICE_CLASS = {m: f"{m}_input" for m in MODALITIES}

#: Service tiers the OpenAI and Anthropic APIs accept (RequestStarted.service_tier holds whatever the
#: client sent; a tier without a multiplier in the price table is priced at 1x).
KNOWN_SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "standard_only")
