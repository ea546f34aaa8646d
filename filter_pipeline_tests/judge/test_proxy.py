"""The judge behind a proxy: HTTP_PROXY / HTTPS_PROXY / NO_PROXY and SSL_CERT_FILE honoured, as curl and the
OpenAI SDK honour them, through a real proxy on 127.0.0.1 in front of the loopback OpenAI-compatible server."""

import base64
import ssl

import pytest

from filter_pipeline.judge.client import EndpointRefused, judge_prompts, ssl_context
from filter_pipeline.judge.transport import env_proxy
from filter_pipeline_tests.judge.asking import prompt, settings
from filter_pipeline_tests.openai_server import FakeOpenAI
from filter_pipeline_tests.proxy_server import LoopbackProxy, self_signed_certificate


@pytest.fixture(autouse=True)
def no_proxy_settings(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


# with an API key the client finds the proxy itself (aiohttp's own lookup would also read ~/.netrc)
WITH_AND_WITHOUT_KEY = pytest.mark.parametrize("api_key", [None, "sk-test-123"], ids=["no-key", "key"])


@WITH_AND_WITHOUT_KEY
def test_requests_go_through_the_proxy_http_proxy_names(monkeypatch, api_key):
    with FakeOpenAI() as server, LoopbackProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        verdicts = judge_prompts([prompt("a"), prompt("b")], settings(server, api_key=api_key))
    assert [v.passed for v in verdicts] == [True, True]
    assert proxy.seen == [f"POST {server.base_url}/chat/completions"] * 2
    assert len(server.calls) == 2


@WITH_AND_WITHOUT_KEY
def test_no_proxy_bypasses_it(monkeypatch, api_key):
    with FakeOpenAI() as server, LoopbackProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
        [verdict] = judge_prompts([prompt("a")], settings(server, api_key=api_key))
    assert verdict.passed is True and len(server.calls) == 1
    assert proxy.seen == []


@WITH_AND_WITHOUT_KEY
def test_an_https_endpoint_through_the_proxy_tunnel_is_trusted_by_the_ca_bundle_ssl_cert_file_names(
    monkeypatch, tmp_path, api_key
):
    cert, key = self_signed_certificate(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    with FakeOpenAI(tls=tls) as server, LoopbackProxy() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        [verdict] = judge_prompts([prompt("a")], settings(server, api_key=api_key))
        assert (verdict.passed, verdict.status) == (True, "judged")
        assert proxy.seen == [f"CONNECT 127.0.0.1:{server.base_url.split(':')[2].split('/')[0]}"]

        monkeypatch.delenv("SSL_CERT_FILE")  # the system's CAs alone do not trust the proxy's certificate
        [untrusted] = judge_prompts([prompt("b")], settings(server, api_key=api_key, task_budget_seconds=0.5))
    assert untrusted.status == "error" and "ClientConnectorCertificateError" in untrusted.why
    assert len(server.calls) == 1


def test_an_unreadable_ca_bundle_is_one_line_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match=r"^SSL_CERT_FILE=.*missing.pem: not a readable CA bundle"):
        ssl_context()


@WITH_AND_WITHOUT_KEY
def test_a_netrc_entry_for_the_endpoints_host_authenticates_only_a_request_without_a_key(
    monkeypatch, tmp_path, api_key
):
    (tmp_path / "netrc").write_text("machine 127.0.0.1 login bob password pw\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with FakeOpenAI() as server:
        [verdict] = judge_prompts([prompt("a")], settings(server, api_key=api_key))
    assert verdict.status == "judged"  # (aiohttp refused a key beside the entry: every request failed)
    expected = f"Bearer {api_key}" if api_key else "Basic " + base64.b64encode(b"bob:pw").decode()
    assert server.calls[0].headers.get("Authorization") == expected


def test_a_proxy_urls_credentials_authenticate_to_the_proxy(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://us%40er:p%3Ass@proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "internal.example")
    proxy, headers = env_proxy("https://api.example/v1/chat/completions")
    expected = "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert proxy == "http://proxy.example:3128" and headers == {"Proxy-Authorization": expected}
    assert env_proxy("https://internal.example/v1/chat/completions") == (None, None)
    assert env_proxy("http://api.example/v1/chat/completions") == (None, None)  # no HTTP_PROXY


def test_a_proxy_refusing_the_https_tunnel_for_want_of_credentials_stops_the_judge_at_once(monkeypatch, tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    with FakeOpenAI(tls=tls) as server, LoopbackProxy(demand_auth=True) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        with pytest.raises(EndpointRefused, match=r"HTTP 407: .*check the proxy's credentials"):
            judge_prompts([prompt(str(i)) for i in range(20)], settings(server, concurrency=4))
    assert len(proxy.seen) <= 10 and server.calls == []
