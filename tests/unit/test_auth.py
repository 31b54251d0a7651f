"""The tokens file and the bearer metadata (kvdepotd.auth), without a daemon."""

from __future__ import annotations

import pytest

from kvdepotd.auth import OPEN, AuthError, Caller, Tokens, Unauthenticated, bearer

GOOD = """
admin = ["admin-token-0123456789"]
[namespaces]
team-a = ["team-a-token-0123456789", "team-a-next-0123456789"]
"" = "default-token-0123456789"
"""


def test_a_tokens_file_maps_each_token_to_its_caller() -> None:
    t = Tokens.parse(GOOD)
    assert len(t) == 4 and t.namespaces == {"team-a", ""} and t.admin_tokens == 1
    assert t.caller([("authorization", "Bearer team-a-next-0123456789")]) == Caller("team-a")
    assert t.caller([("x-other", "1"), ("authorization", "bearer default-token-0123456789")]) == Caller("")
    assert t.caller([("authorization", "Bearer admin-token-0123456789")]).admin


def test_who_may_use_which_namespace() -> None:
    assert Caller("team-a").may_use("team-a") and not Caller("team-a").may_use("team-b") and not Caller("team-a").may_use("")
    assert Caller("", admin=True).may_use("team-b") and OPEN.may_use("anything")


@pytest.mark.parametrize(
    "metadata, error",
    [(None, "requires a token"), ([("authorization", "Basic dXNlcg==")], "requires a token"), ([("authorization", "Bearer nope")], "not one this daemon knows")],
)
def test_calls_without_a_known_bearer_token_are_refused(metadata: list[tuple[str, str]] | None, error: str) -> None:
    with pytest.raises(Unauthenticated, match=error):
        Tokens.parse(GOOD).caller(metadata)


@pytest.mark.parametrize(
    "text, error",
    [
        ("admin = [", "is not valid TOML"),
        ('[namespaces]\nteam-a = "short"', "namespace 'team-a': a token must be at least 16 characters"),
        ("[namespaces]\n", "lists no tokens"),
        ('admin = "same-token-0123456789"\n[namespaces]\nteam-a = "same-token-0123456789"', "namespace 'team-a' repeats a token"),
        ('tokens = ["x"]', "unknown keys ['tokens']"),
        ('namespaces = "team-a"', "'namespaces' must be a table"),
        ("admin = 42", "admin must be a token or a list of tokens"),
        ('admin = "two words-0123456789"', "printable ASCII without spaces"),
        (f'[namespaces]\n"{"n" * 300}" = "long-namespace-0123456789"', "longer than 256 characters"),
    ],
)
def test_a_bad_tokens_file_says_what_is_wrong(text: str, error: str) -> None:
    with pytest.raises(AuthError, match=error.replace("[", r"\[").replace("]", r"\]")):
        Tokens.parse(text, "tokens.toml")


def test_bearer_reads_only_the_authorization_metadata() -> None:
    assert bearer([("authorization", "Bearer  abc ")]) == "abc"
    assert bearer([("authorization-x", "Bearer abc")]) is None
    assert bearer(()) is None
