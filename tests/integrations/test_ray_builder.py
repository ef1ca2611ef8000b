"""The application builder: ``serve run``'s arguments, Ray's own deployment options."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'loraplex[ray]'")

from loraplex.integrations.ray_serve import RayServeOptions, ResidencyRequestRouter, app, build_app
from loraplex.integrations.ray_serve.testbed import TinyFleet


def _engine(application: object) -> object:
    return application._bound_deployment.init_args[0]._bound_deployment  # type: ignore[attr-defined]


def test_serve_run_arguments_build_the_app(testbed: TinyFleet) -> None:
    argv = (
        f"{testbed.model} --enable-lora --served-model-name tiny --max-loras 1 "
        f"--max-cpu-loras 3 --registry-url {testbed.registry_url}"
    )
    application = app(
        {
            "serve_args": argv,
            "routing": "residency",
            "autoscaling_config": '{"min_replicas": 1, "max_replicas": 4, '
            '"target_ongoing_requests": 8}',
            "max_ongoing_requests": "32",
        }
    )
    ingress = application._bound_deployment  # type: ignore[attr-defined]
    assert ingress.name == "LoraplexIngress"
    engine = _engine(application)
    assert engine.name == "LoraplexEngine"
    assert engine.max_ongoing_requests == 32
    auto = engine._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 4, 8)
    router = engine._deployment_config.request_router_config
    assert router.get_request_router_class() is ResidencyRequestRouter
    config = engine.init_args[0]
    assert config.engine.max_cpu_loras == 3 and config.registry_url == testbed.registry_url


def test_ray_s_own_routers_for_the_other_modes(testbed: TinyFleet) -> None:
    for routing in ("multiplex", "default"):
        engine = _engine(
            build_app(testbed.server_config(), RayServeOptions(routing=routing, num_replicas=2))
        )
        assert engine.num_replicas == 2
        router = engine._deployment_config.request_router_config
        assert router.get_request_router_class() is not ResidencyRequestRouter


def test_bad_arguments_are_refused_by_name(testbed: TinyFleet) -> None:
    argv = f"{testbed.model} --enable-lora"
    with pytest.raises(ValueError, match=r"unknown argument.*replicas"):
        app({"serve_args": argv, "replicas": 2})
    with pytest.raises(ValueError, match="routing must be one of"):
        app({"serve_args": argv, "routing": "random"})
    with pytest.raises(ValueError, match="not both"):
        RayServeOptions(num_replicas=2, autoscaling_config={"max_replicas": 3})
    with pytest.raises(ValueError, match="serve_args is required"):
        app({"routing": "residency"})
