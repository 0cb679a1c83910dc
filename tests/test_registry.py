"""The one `Registry` type behind environments and verifiers: names, references, checks."""

import pytest

from jaxrl_llm import envs, verifiers
from jaxrl_llm.envs import base
from jaxrl_llm.registry import Registry
from jaxrl_llm.verifiers import numeric
from jaxrl_llm.verifiers import registry as verifier_registry


def _fresh() -> Registry:
    return Registry(
        "verifier",
        builtins={"gsm8k": "jaxrl_llm.verifiers.numeric:gsm8k"},
        kind="function",
        check=callable,
        expected="a function",
        build=lambda fn, options: (fn, options),
        fixed_args=2,
    )


def test_registered_names_travel_as_module_references():
    """A worker has not run the registering module's decorator: the name it receives is
    the 'module:attr' it can import."""
    reg = _fresh()
    reg.register("mine")(numeric.gsm8k)
    assert reg.canonical("mine") == "jaxrl_llm.verifiers.numeric:gsm8k"
    assert reg.canonical("gsm8k") == "gsm8k"  # built-ins: every worker knows them
    assert reg.resolve("mine") is numeric.gsm8k
    assert reg.get("mine", answer_key="label") == (numeric.gsm8k, {"answer_key": "label"})
    assert reg.known() == ["gsm8k", "mine"]


def test_register_refuses_built_ins_and_local_functions():
    reg = _fresh()
    with pytest.raises(ValueError, match="that name is a built-in verifier"):
        reg.register("gsm8k")(numeric.gsm8k)

    def local(completion, example):
        return 0.0

    with pytest.raises(ValueError, match="'path/to/file.py:function'"):
        reg.register("local")(local)


def test_unknown_and_unimportable_names_are_one_line_value_errors():
    reg = _fresh()
    with pytest.raises(ValueError, match="unknown verifier 'x'; built-ins and registered: gsm8k"):
        reg.resolve("x")
    with pytest.raises(ValueError, match="verifier 'no_such_module:f': No module named"):
        reg.resolve("no_such_module:f")
    with pytest.raises(ValueError, match="'nothing' is not a function in"):
        reg.resolve("jaxrl_llm.verifiers.numeric:nothing")


def test_each_public_name_is_the_instance_method():
    for module, registry in ((base, base.ENVS), (verifier_registry, verifier_registry.VERIFIERS)):
        for name in ("register", "canonical", "resolve", "get", "check_options"):
            assert getattr(module, name) == getattr(registry, name), (module, name)
        assert module.BUILTINS is registry.builtins
    assert envs.register == base.ENVS.register and verifiers.get == verifier_registry.VERIFIERS.get
