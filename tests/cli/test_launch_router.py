"""``launch --router vllm-router``: vllm-router in front of the same instances, the port relation it needs."""

from __future__ import annotations

from lmcache_p2p.cli import launch, routers
from lmcache_p2p.cli.main import build_parser
from lmcache_p2p.config import P2PConfig


def parse(*argv: str):
    return build_parser().parse_args(["launch", "--model", "/tmp", *argv])


def test_vllm_router_fronts_every_instance_and_each_decoders_control_port_is_its_http_port_plus_one_offset(tmp_path):
    args = parse("--router", "vllm-router", "--prefill", "2", "--decode", "2")
    instances = launch.plan(args)
    decoders = [i for i in instances if i.role == "decoder"]
    assert [d.http_port for d in decoders] == [7200, 7210] and [d.control_port for d in decoders] == [7300, 7310]
    site = launch.local_site(args, tmp_path)
    for inst in instances:
        p2p = launch.lmcache_config(inst, args, site)["extra_config"]["p2p"]
        assert "proxy_url" not in p2p  # nothing to announce to
        cfg = P2PConfig.from_mapping(p2p)  # a decoder checks the relation against its own ports here
        assert cfg.router_control_port_offset == 100
        if inst.role == "prefiller":
            assert cfg.router_decoder_tp_size == 1
    front = launch.proxy_child(args, tmp_path)
    assert front.argv[1:4] == ["-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
    assert " ".join(front.argv).endswith("--prefill http://127.0.0.1:7100 --prefill http://127.0.0.1:7101 "
                                         "--decode http://127.0.0.1:7200 --decode http://127.0.0.1:7210")
    assert front.argv[front.argv.index("--port") + 1] == "9100"
    assert front.argv[front.argv.index("--prometheus-port") + 1] == "9101"
    assert {u.port for u in launch.planned_ports(args)} >= {9100, 9101, 7100, 7101, 7200, 7210, 7300, 7310}


def test_our_proxy_is_the_default_and_sets_no_router_keys(tmp_path):
    args = parse("--decode", "2")
    assert routers.router_of(args) is routers.Router.LMCACHE_P2P
    assert [i.http_port for i in launch.plan(args) if i.role == "decoder"] == [7200, 7201]
    for inst in launch.plan(args):
        p2p = launch.lmcache_config(inst, args, launch.local_site(args, tmp_path))["extra_config"]["p2p"]
        assert p2p["proxy_url"] == "tcp://127.0.0.1:9101" and "router_control_port_offset" not in p2p


def test_demo_needs_our_proxy(tmp_path, caplog):
    args = parse("--router", "vllm-router", "--demo", "--log-dir", str(tmp_path))
    assert launch.run(args) == 2
    assert "--demo reads our proxy's /stats" in caplog.text
