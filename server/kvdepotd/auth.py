"""Tokens: who may call the daemon, and for which namespace (kvdepotd --auth-file).

    Tokens.parse(text, source) / Tokens.load(path)   the tokens file, checked; AuthError says what is wrong
    Tokens.caller(metadata)                          the Caller a call's "authorization: Bearer" metadata
                                                     speaks for; Unauthenticated when none or unknown
    Caller.may_use(namespace)                        an engine of that namespace is the caller's to drive
    OPEN                                             the caller of a daemon without tokens: may do everything

The tokens file (TOML):

    admin = ["<token>"]                 # any namespace, Clear; a string or a list of strings
    [namespaces]
    team-a = ["<token>", "<next>"]      # several tokens: rotate without a gap
    "" = "<token>"                      # the default namespace

A namespace token registers engines in its namespace only (the namespace folds into every block
hash, so its engines never hit another namespace's blocks) and drives only those engines. The
service checks; the core knows nothing of tokens.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvdepot.auth import check_token
from kvdepotd.core.errors import DepotError, NotFound, not_registered
from kvdepotd.core.slots import MAX_ID_LEN

MIN_TOKEN_LEN = 16
PREFIX = "bearer "


class AuthError(ValueError):
    """The tokens file is wrong; the message says where."""


class Unauthenticated(DepotError):
    """No token, or one the daemon does not know (UNAUTHENTICATED)."""


class PermissionDenied(DepotError):
    """A known token asking for what it may not do (PERMISSION_DENIED)."""


class ForeignEngine(NotFound):
    """An engine of another namespace than the token's. The caller is told what it would be told of
    an engine that does not exist (NOT_FOUND, the same words), so a token learns nothing about other
    namespaces' engines; `audit` says what happened, for the daemon's log."""

    def __init__(self, engine_id: str, caller: Caller) -> None:
        super().__init__(not_registered(engine_id))
        self.audit = f"engine {engine_id} is not in the namespace of the call's token ({caller.describe()}); answered as not registered"


@dataclass(frozen=True, slots=True)
class Caller:
    namespace: str
    admin: bool = False

    def may_use(self, namespace: str) -> bool:
        return self.admin or namespace == self.namespace

    def describe(self) -> str:
        return "an admin token" if self.admin else f"a token of namespace {self.namespace!r}"


OPEN = Caller("", admin=True)


class Tokens:
    def __init__(self, callers: dict[str, Caller], source: str = "", scrapers: frozenset[str] = frozenset()) -> None:
        self._callers = callers
        self.source = source
        self._scrapers = scrapers  # tokens that may read /metrics and nothing else

    def is_admin(self, token: str | None) -> bool:
        return token is not None and (c := self._callers.get(token)) is not None and c.admin

    def may_scrape(self, token: str | None) -> bool:
        """A metrics token or an admin token: /metrics names every namespace."""
        return token is not None and (token in self._scrapers or self.is_admin(token))

    @property
    def namespaces(self) -> set[str]:
        return {c.namespace for c in self._callers.values() if not c.admin}

    @property
    def admin_tokens(self) -> int:
        return sum(c.admin for c in self._callers.values())

    def __len__(self) -> int:
        return len(self._callers)

    def summary(self) -> str:
        """Whom the tokens speak for, for the log and check-config: "(namespaces 'a', 'b'; 1 admin)"."""
        names = ", ".join(repr(n) for n in sorted(self.namespaces)) or "none"
        return f"(namespaces {names}; {self.admin_tokens} admin; {len(self._scrapers)} metrics)"

    def caller(self, metadata: Iterable[tuple[str, Any]] | None) -> Caller:
        token = bearer(metadata)
        if token is None:
            raise Unauthenticated("this daemon requires a token: send the metadata 'authorization: Bearer <token>'")
        c = self._callers.get(token)
        if c is None:
            if token in self._scrapers:
                raise PermissionDenied("a metrics token reads /metrics and nothing else")
            raise Unauthenticated("the token is not one this daemon knows")
        return c

    @staticmethod
    def load(path: str) -> Tokens:
        try:
            with open(path, "rb") as f:
                text = f.read().decode()
        except OSError as e:
            raise AuthError(f"cannot read the tokens file {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise AuthError(f"the tokens file {path} is not UTF-8 text") from None
        return Tokens.parse(text, path)

    @staticmethod
    def parse(text: str, source: str = "tokens file") -> Tokens:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise AuthError(f"{source} is not valid TOML: {e}") from None
        unknown = sorted(set(data) - {"admin", "metrics", "namespaces"})
        if unknown:
            raise AuthError(f"{source}: unknown keys {unknown}; it holds 'admin', 'metrics' and a [namespaces] table")
        namespaces = data.get("namespaces", {})
        if not isinstance(namespaces, dict):
            raise AuthError(f"{source}: 'namespaces' must be a table of namespace = token(s)")
        callers: dict[str, Caller] = {}
        entries = [("admin", Caller("", admin=True), data.get("admin", []))]
        entries += [(f"namespace {ns!r}", Caller(ns), v) for ns, v in namespaces.items()]
        for where, caller, value in entries:
            if len(caller.namespace) > MAX_ID_LEN:
                raise AuthError(f"{source}: {where} is longer than {MAX_ID_LEN} characters")
            for token in _token_list(value, f"{source}: {where}"):
                if token in callers:
                    raise AuthError(f"{source}: {where} repeats a token given before (each token speaks for one caller)")
                callers[token] = caller
        if not callers:
            raise AuthError(f"{source} lists no tokens: the daemon would refuse every caller")
        scrapers = _token_list(data.get("metrics", []), f"{source}: metrics")
        if repeated := set(scrapers) & set(callers):
            raise AuthError(f"{source}: metrics repeats a token given before ({len(repeated)} of them; each token speaks for one caller)")
        return Tokens(callers, source, frozenset(scrapers))


def _token_list(value: Any, where: str) -> list[str]:
    tokens = [value] if isinstance(value, str) else value
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise AuthError(f"{where} must be a token or a list of tokens (strings)")
    for t in tokens:
        if len(t) < MIN_TOKEN_LEN:
            raise AuthError(f"{where}: a token must be at least {MIN_TOKEN_LEN} characters (try `openssl rand -hex 24`)")
        try:
            check_token(t)  # the client's rule: it must travel as gRPC metadata
        except ValueError as e:
            raise AuthError(f"{where}: {e}") from None
    return tokens


def bearer(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of the call's "authorization: Bearer TOKEN" metadata, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[: len(PREFIX)].lower() == PREFIX:
            return value[len(PREFIX) :].strip()
    return None
