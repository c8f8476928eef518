"""The lean sender of one-shot calls over the local socket (torpor.client._wire): it sends
what httpx would (the query parameters, the path), so the server cannot tell them apart."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx
from hypothesis import given
from hypothesis import strategies as st

from torpor.client._wire import query_string

VALUES = st.one_of(
    st.text(max_size=20), st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False)
)
PARAMS = st.one_of(
    st.dictionaries(st.text(min_size=1, max_size=10), st.one_of(VALUES, st.lists(VALUES))),
    st.lists(st.tuples(st.text(min_size=1, max_size=10), VALUES)),
)


def _values(query: str) -> dict[str, list[str]]:
    # each name's values in order (httpx groups a repeated name's values together)
    out: dict[str, list[str]] = {}
    for k, v in parse_qsl(query, keep_blank_values=True):
        out.setdefault(k, []).append(v)
    return out


@given(PARAMS)
def test_query_string_decodes_as_httpx_s_does(params: Any) -> None:
    theirs = httpx.Request("GET", "http://torpor/x", params=params).url.query.decode()
    assert _values(query_string(params)) == _values(theirs)


def test_no_params_no_query() -> None:
    assert query_string(None) == query_string({}) == query_string([]) == ""
    assert urlsplit("/v1/x?" + query_string({"a": "b c"})).query == "a=b+c"
