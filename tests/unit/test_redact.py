"""``redact``: what the inbox stores of a provider payload (credentials and signed URLs out)."""

from __future__ import annotations

import copy
import json
from collections import UserDict
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from aivedio.providers.redact import REDACTED, redact
from aivedio.providers.standard_webhooks import StandardWebhooksJson
from aivedio.providers.verify import StandardWebhooksVerifier

URL_KEYS = frozenset({"url"})


def test_secrets_urls_and_links_are_redacted_at_any_depth() -> None:
    payload = {
        "Token": "t0p",
        "data": {
            "output": {"url": "https://cdn.example/v.mp4?sig=1", "content_type": "video/mp4"},
            "callback": "https://x.example/cb?token=abc#frag",
            "plain": "https://x.example/page",
            "items": [
                "https://user:pw@h.example/a?b=c",
                {"API_KEY": 7, "keep": 1.5},
                ["nested", {"signature": None}],
            ],
            "count": 3,
            "flag": True,
            "none": None,
        },
    }
    before = copy.deepcopy(payload)
    result = redact(payload, URL_KEYS)
    assert payload == before  # never modified in place
    assert result == {
        "Token": REDACTED,
        "data": {
            "output": {"url": REDACTED, "content_type": "video/mp4"},
            "callback": "https://x.example/cb?[redacted]",
            "plain": "https://x.example/page",
            "items": [
                "https://h.example/a?[redacted]",
                {"API_KEY": REDACTED, "keep": 1.5},
                ["nested", {"signature": REDACTED}],
            ],
            "count": 3,
            "flag": True,
            "none": None,
        },
    }
    assert result["data"]["items"][2][0] == "nested"


def test_nothing_to_redact_returns_the_same_objects() -> None:
    payload = {"a": {"b": ["c", 1, {"url": None}]}, "s": "not a :// url"}
    assert redact(payload, URL_KEYS) is payload


def test_unchanged_branches_are_shared_not_copied() -> None:
    payload = {"keep": {"x": [1, 2]}, "token": "s"}
    result = redact(payload, URL_KEYS)
    assert result is not payload
    assert result["keep"] is payload["keep"]


def test_subclasses_of_the_json_types_are_redacted_too() -> None:
    class Text(str):
        pass

    class Obj(dict[str, Any]):
        pass

    payload = {"inner": Obj(password="p"), "link": Text("https://h.example/?q=1")}
    assert redact(payload, URL_KEYS) == {
        "inner": {"password": REDACTED},
        "link": "https://h.example/?[redacted]",
    }


def test_a_mapping_that_is_not_a_dict_is_redacted_too() -> None:
    nested = {"inner": UserDict({"token": "t", "keep": 1})}
    assert redact(nested, URL_KEYS) == {"inner": {"token": REDACTED, "keep": 1}}
    provider = StandardWebhooksJson("p", StandardWebhooksVerifier([("v", "whsec_" + "A" * 32)]))
    assert provider.minimize(UserDict({"secret": "s", "n": 1})) == {"secret": REDACTED, "n": 1}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["token", "URL", "url", "id", "Signature", "data", "x"]) | st.text(),
            children,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@given(json_values)
def test_redaction_is_idempotent_and_leaves_no_secret_value(value: Any) -> None:
    before = json.dumps(value, sort_keys=True)
    once = redact(value, URL_KEYS)
    assert json.dumps(value, sort_keys=True) == before  # the argument is untouched
    assert redact(once, URL_KEYS) == once

    def check(node: Any) -> None:
        if isinstance(node, dict):
            for key, item in node.items():
                if key.lower() in ("token", "signature") or (
                    key.lower() == "url" and item is not None
                ):
                    assert item == REDACTED
                else:
                    check(item)
        elif isinstance(node, list):
            for item in node:
                check(item)

    check(once)
