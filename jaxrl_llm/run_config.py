"""`base_config` where experiment files written before `jaxrl_llm.config` import it from
(`from jaxrl_llm.run_config import base_config`); new files import `jaxrl_llm.config`."""

from jaxrl_llm.config import base_config

__all__ = ["base_config"]
