"""Which KVDEPOT_* environment variables are the daemon's options. The prefix is shared: the
connectors, the project's scripts, tests and container files, and Kubernetes' service links all
set KVDEPOT_* variables too; any other one is refused, as a misspelled option would otherwise be
ignored.

    options_in(env, options) -> {option: value}   raises ValueError naming an unknown variable
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping

from kvdepot.connector.config import ENV_NAMES as CONNECTOR_ENV

ENV_PREFIX = "KVDEPOT_"
# The KVDEPOT_* variables that are not the daemon's options: the connectors' (CONNECTOR_ENV) and
# those of the project's scripts, tests and container files (docs/development.md, docs/deploy.md).
OTHER_ENV = CONNECTOR_ENV | {
    ENV_PREFIX + name
    for name in (
        "CONFIG", "COMPILE", "EXPECT_COMPILED", "REQUIRE_CONTAINERS", "REQUIRE_MONITORING", "REQUIRE_TLS_STORE", "VALKEY_SERVER",
        "SOAK_S", "IMAGE", "ENGINE_IMAGE", "CONTAINER_STATE", "MODELS", "MODEL", "DTYPE", "MAX_MODEL_LEN", "ENGINE_KV_GIB", "PORT",
        "METRICS_PORT", "ENGINE_PORT", "DEBIAN_MIRROR",
    )
}
# What Kubernetes puts in every container's environment for a Service named kvdepot (or kvdepot-*)
# in the namespace: KVDEPOT_SERVICE_HOST, KVDEPOT_PORT_50061_TCP_ADDR and the like (the manifests
# turn them off with enableServiceLinks: false; other pods' may not).
SERVICE_LINK = re.compile(r"KVDEPOT_(?:[A-Z0-9_]+_)?(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?|PORT(?:_\d+_(?:TCP|UDP|SCTP)(?:_(?:ADDR|PORT|PROTO))?)?)")


def options_in(env: Mapping[str, str], options: Collection[str]) -> dict[str, str]:
    """The values `env` gives the daemon's `options` (by option name); raises ValueError naming the
    first KVDEPOT_* variable that is neither an option nor another's, and the nearest option."""
    out = {}
    for k, v in env.items():
        name = k[len(ENV_PREFIX) :].lower()
        if not k.startswith(ENV_PREFIX) or k in OTHER_ENV:
            continue
        if name not in options:
            if SERVICE_LINK.fullmatch(k):
                continue
            near = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
            hint = f"; did you mean {ENV_PREFIX}{near[0].upper()}?" if near else ""
            raise ValueError(
                f"unknown variable {k} in the environment{hint} (every KVDEPOT_* variable must be an option of the daemon "
                "or one the connectors or the project's scripts read; docs/operations.md lists the options)"
            )
        out[name] = v
    return out
