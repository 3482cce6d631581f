"""Output-length predictors: predict a request's output-length bucket, learn from finished ones.

    from predictors import get_predictor, load_predictor
    p = get_predictor("sklearn", granularity=200).fit(examples)
    ranges = p.predict(requests)          # list[LengthRange]
    p.observe(request, actual_length)     # online backends learn from it

Backends: none, oracle, sklearn, lm, retrieval, accuracy (see ``predictors.registry``).
"""
from predictors.base import GRANULARITIES, Buckets, LengthPredictor
from predictors.registry import BACKENDS, get_predictor, load_predictor

__all__ = ["BACKENDS", "GRANULARITIES", "Buckets", "LengthPredictor", "get_predictor", "load_predictor"]
