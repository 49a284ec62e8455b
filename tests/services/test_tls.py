"""TLS on the internal hops: mutual TLS between decode and prefill, refused without the right certificate."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from tandem.decode_svc.server import create_servicer
from tandem.engine.engine import Engine
from tandem.prefill_svc.servicer import PrefillServicer
from tandem.prefill_svc.servicer import add_to_server as add_prefill_to_server
from tandem.serving.async_engine import AsyncEngine
from tandem.serving.rpc import TlsConfig, make_channel, start_server
from tandem.v1 import worker_pb2_grpc
from tests.factories import prompts_for, save_random_hf_model
from tests.services.test_disaggregated import decode_request, engine_config, reference_tokens

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, and one certificate it signs for 127.0.0.1 (every service here presents it)."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=tandem-test-ca", cwd=d)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "svc.key", "-out", "svc.csr",
            "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "svc.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "svc.pem", "-days", "1", "-extfile", "san.ext", cwd=d)
    # A second CA, whose certificates the services must not accept.
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.pem",
            "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", cwd=d)
    return d


async def test_mutual_tls_between_decode_and_prefill(pki: Path, tmp_path: Path) -> None:
    save_random_hf_model(tmp_path)
    tls = TlsConfig(str(pki / "svc.pem"), str(pki / "svc.key"), str(pki / "ca.pem"))
    engines = [AsyncEngine(Engine(engine_config(tmp_path)), name=f"tls-{i}") for i in range(2)]
    prefill = PrefillServicer(engines[0], "test")
    decode = create_servicer(engines[1], "test", tls=tls)
    servers = []
    try:
        addresses = []
        for servicer, add, name in ((prefill, add_prefill_to_server, "Prefill"),
                                    (decode, worker_pb2_grpc.add_DecodeServicer_to_server, "Decode")):
            def register(server: grpc.aio.Server, servicer=servicer, add=add, name=name) -> list[str]:  # noqa: ANN001
                add(servicer, server)
                return [f"tandem.v1.{name}"]
            server, port, _ = await start_server("127.0.0.1:0", register, tls=tls)
            servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        prompt = prompts_for(512, [19])[0]
        request = decode_request("tls", prompt, addresses[0])

        # With the CA's certificate: served, and the prompt was prefilled remotely over TLS.
        async with make_channel(addresses[1], tls=tls) as channel:
            tokens, local = [], -1
            async for response in worker_pb2_grpc.DecodeStub(channel).Generate(request, timeout=60):
                local = response.num_local_prefill_tokens if local < 0 else local
                tokens += response.token_ids
        assert tokens == reference_tokens(tmp_path, [prompt])[0] and local == 0

        # Plaintext, no client certificate, or a certificate from another CA: refused.
        anonymous = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
        stranger = TlsConfig(str(pki / "other.pem"), str(pki / "other.key"), str(pki / "ca.pem"))
        for channel in (grpc.aio.insecure_channel(addresses[1]), grpc.aio.secure_channel(addresses[1], anonymous),
                        make_channel(addresses[1], tls=stranger)):
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in worker_pb2_grpc.DecodeStub(channel).Generate(request, timeout=5):
                        pass
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for server in servers:
            await server.stop(0)
        for engine in engines:
            engine.close()
