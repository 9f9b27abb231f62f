"""The production prefill/decode split as an SGLang plugin: BF16 prefill pages converted in transit into the
decode's FP8 rows (`sglang`: the hooks; `staging`: the bounded staging area, plain torch). The pair itself, as
data, is `quantkit.engines.pd`."""
