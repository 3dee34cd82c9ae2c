"""The pydantic models of every request and response: the API's documentation (/docs, /openapi.json).

A table is JSON in one of two orientations, told apart by shape:
- records: [{"a": 1.5, "b": "x"}, {"a": null, "b": "y"}]  (every row has the same keys)
- columns: {"a": [1.5, null], "b": ["x", "y"]}            (every column has the same length)
A cell is a number, a string, a boolean or null (missing). Large tables go as Arrow IPC or
Parquet bodies instead (see docs/serving.md): the same fields then come as query parameters.

Estimator parameters are optional fields with the in-process estimators' defaults; the server
fixes model, device and precision. Unknown fields are refused (422 naming the field).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from tabfm.estimators.local_context import LOCAL_CONTEXT_ROWS
from tabfm.estimators.base import (DEFAULT_MAX_COLUMNS, DEFAULT_MAX_COLUMNS_SUPERVISED, DEFAULT_MAX_CONTEXT_ROWS,
                                   DEFAULT_N_ESTIMATORS, DEFAULT_N_NEIGHBORS)
from tabfm.estimators import anomaly
from tabfm.estimators.imputer import DEFAULT_LOCAL_CONTEXT, DEFAULT_ROUND_PARTS
from tabfm.inference import DEFAULT_CHUNK_SIZE

Cell = Union[StrictBool, StrictInt, float, str, None]
Records = list[dict[str, Cell]]
Columns = dict[str, list[Cell]]
Table = Annotated[Union[Records, Columns], Field(
    description="a table: a list of row objects (records) or an object of equal-length column arrays (columns)")]
TASKS = ("classification", "regression", "imputation", "anomaly")
Task = Literal["classification", "regression", "imputation", "anomaly"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- estimator parameters
class CommonParams(Strict):
    """Parameters every estimator takes (see docs/estimators.md)."""

    n_estimators: int = Field(DEFAULT_N_ESTIMATORS, ge=1, description="ensemble members (<= the server's --max-estimators)")
    random_state: Optional[int] = Field(0, ge=0, le=2**32 - 1, description="seed; null draws one (returned by "
                                        "context registration, so later requests repeat it)")
    max_context_rows: int = Field(DEFAULT_MAX_CONTEXT_ROWS, ge=1, description="context rows per member")
    chunk_size: int = Field(DEFAULT_CHUNK_SIZE, ge=1, le=4096, description="query rows per model pass")


class SupervisedParams(CommonParams):
    max_columns: int = Field(DEFAULT_MAX_COLUMNS_SUPERVISED, ge=1, description="encoded columns per member")
    categorical: Literal["ordinal", "identity"] = "ordinal"
    n_neighbors: Union[int, list[int]] = Field(list(DEFAULT_N_NEIGHBORS), description="neighbour feature sizes; 0 = off")
    linear_features: bool = True
    local_context: int = Field(LOCAL_CONTEXT_ROWS, ge=0, description="rows of the local contexts read by every "
                               "second pair of members (tables with more training rows only); 0 = off")


class ClassifierParams(SupervisedParams):
    """TabFMClassifier's parameters."""

    numeric: Literal["raw", "quantile", "mixed"] = "mixed"
    multiclass: Literal["auto", "ovr", "native", "ecoc"] = Field("auto", description="auto: ecoc for weights "
                                                                 "with context features, else ovr")
    n_codebooks: Optional[int] = Field(None, ge=1, description="multiclass=ecoc: codebooks (passes) per member; "
                                       "null = automatic")
    alphabet_size: Optional[int] = Field(None, ge=2, description="multiclass=ecoc: meta-classes per codebook "
                                         "(at most the head's codes); null = automatic")
    max_classes: int = Field(100, ge=2, description="refuse a numeric target with more distinct values")


class RegressorParams(SupervisedParams):
    """TabFMRegressor's parameters."""

    numeric: Literal["raw", "quantile", "mixed"] = "quantile"
    linear_residual: Union[StrictBool, Literal["mixed"]] = Field("mixed", description="true: predict a ridge regression's "
                                                          "residual; false: the target; mixed: half the members each")


class ImputerParams(CommonParams):
    """TabFMImputer's parameters."""

    max_columns: int = Field(DEFAULT_MAX_COLUMNS, ge=1)
    strategy: Literal["columns", "joint"] = Field("columns", description="columns: each column with missing cells "
                                                  "predicted as a supervised target; joint: a row's missing cells in one pass")
    n_rounds: int = Field(1, ge=1, le=10, description="rounds: each later one re-predicts the missing cells with the "
                                                        "others filled by the previous round's estimates")
    round_parts: int = Field(DEFAULT_ROUND_PARTS, ge=1, description="strategy=joint, rounds after the first: at most this many parts a "
                             "row's missing columns are re-predicted in, each with the others filled")
    local_context: int = Field(DEFAULT_LOCAL_CONTEXT, ge=0, description="strategy=columns: the column estimators' "
                               "local contexts (rows; 0 = off)")


class AnomalyParams(CommonParams):
    """TabFMAnomalyDetector's parameters (its own defaults for members and context rows)."""

    n_estimators: int = Field(anomaly.DETECTOR_N_ESTIMATORS, ge=1, description="ensemble members (<= the server's "
                              "--max-estimators)")
    max_context_rows: int = Field(anomaly.DETECTOR_MAX_CONTEXT_ROWS, ge=1, description="context rows per member")

    max_columns: int = Field(DEFAULT_MAX_COLUMNS, ge=1)
    contamination: float = Field(0.1, gt=0.0, le=0.5, description="expected outlier share: sets the offset")
    n_folds: int = Field(5, ge=2)
    max_offset_rows: Optional[int] = Field(512, ge=1)
    columns_per_copy: Union[int, float] = Field(
        anomaly.DEFAULT_COLUMNS_PER_COPY, description="source columns hidden together per query copy of a row: an int >= 1, "
        "or a fraction in (0, 1] of the scored columns; fewer copies, fewer passes",
        json_schema_extra={"anyOf": [{"type": "integer", "minimum": 1},
                                     {"type": "number", "exclusiveMinimum": 0, "maximum": 1}]})

    @field_validator("columns_per_copy", mode="plain")
    @classmethod
    def _columns_per_copy(cls, value: Any) -> Union[int, float]:
        """One check for both forms, so a refusal names the field itself (not a branch of a union)."""
        if anomaly.valid_columns_per_copy(value):
            return value
        raise ValueError(f"must be an int >= 1 or a float in (0, 1], got {value!r}")


PARAMS = {"classification": ClassifierParams, "regression": RegressorParams, "imputation": ImputerParams,
          "anomaly": AnomalyParams}
AnyParams = Union[ClassifierParams, RegressorParams, ImputerParams, AnomalyParams]


# ----------------------------------------------------------------------------- requests
class _OneShotOrRegistered(Strict):
    context: Optional[Table] = Field(None, description="context rows (with the target column for classify / regress)")
    context_id: Optional[str] = Field(None, description="a registered context (POST /v1/contexts) instead of `context`")

    @model_validator(mode="after")
    def _one_context(self):
        if self.context is not None and self.context_id is not None:
            raise ValueError("give either `context` or `context_id`, not both")
        if self.context_id is not None and "params" in self.model_fields_set:
            raise ValueError("`params` belong to the registered context (fixed at POST /v1/contexts); "
                             "leave them out with `context_id`")
        return self


class _Supervised(_OneShotOrRegistered):
    target: Optional[str] = Field(None, description="the context's target column (with `context`)")
    query: Table = Field(description="rows to predict (feature columns; a target column there is ignored)")

    @model_validator(mode="after")
    def _target(self):
        if self.context is None and self.context_id is None:
            raise ValueError("give `context` (with `target`) or a registered `context_id`")
        if self.context is not None and not self.target:
            raise ValueError("`target` names the context's target column; it is required with `context`")
        return self


class ClassifyRequest(_Supervised):
    """Class labels (and probabilities) of the query rows, the context rows as labelled examples."""

    params: ClassifierParams = Field(default_factory=ClassifierParams)
    return_proba: bool = Field(True, description="include the class probabilities")


class RegressRequest(_Supervised):
    """Predictive mean (and quantiles) of the target of the query rows."""

    params: RegressorParams = Field(default_factory=RegressorParams)
    quantiles: list[Annotated[float, Field(gt=0.0, lt=1.0)]] = Field(
        default_factory=list, max_length=99, description="quantile levels in (0, 1) to return, e.g. [0.1, 0.5, 0.9]")


class ImputeRequest(_OneShotOrRegistered):
    """The query rows with every missing cell filled; without a context they are their own context."""

    query: Table = Field(description="rows whose missing (null) cells to fill")
    params: ImputerParams = Field(default_factory=ImputerParams)


class AnomalyRequest(_OneShotOrRegistered):
    """Anomaly scores of the query rows (without `query`: of the context rows, each scored without itself)."""

    query: Optional[Table] = Field(None, description="rows to score (default: the context rows)")
    params: AnomalyParams = Field(default_factory=AnomalyParams)

    @model_validator(mode="after")
    def _needs_context(self):
        if self.context is None and self.context_id is None:
            raise ValueError("give `context` or a registered `context_id`")
        return self


class _Register(Strict):
    context: Table = Field(description="the context rows (with the target column for classification / regression)")
    target: Optional[str] = Field(None, description="target column (classification, regression)")


class RegisterClassification(_Register):
    task: Literal["classification"]
    params: ClassifierParams = Field(default_factory=ClassifierParams)


class RegisterRegression(_Register):
    task: Literal["regression"]
    params: RegressorParams = Field(default_factory=RegressorParams)


class RegisterImputation(_Register):
    task: Literal["imputation"]
    params: ImputerParams = Field(default_factory=ImputerParams)


class RegisterAnomaly(_Register):
    task: Literal["anomaly"]
    params: AnomalyParams = Field(default_factory=AnomalyParams)


RegisterRequest = Annotated[Union[RegisterClassification, RegisterRegression, RegisterImputation, RegisterAnomaly],
                            Field(discriminator="task")]


# ----------------------------------------------------------------------------- responses
class _Answer(BaseModel):
    model: str = Field(description="the weights that answered")
    context_id: Optional[str] = None
    n_rows: int = Field(description="query rows answered")
    warnings: list[str] = Field(default_factory=list, description="what the estimator warned about")


class ClassifyResponse(_Answer):
    predictions: list[Cell] = Field(description="the most probable class of each query row")
    classes: list[Cell] = Field(description="the classes, in the order of the probability columns")
    probabilities: Optional[list[list[float]]] = Field(None, description="(rows x classes), rows sum to 1")


class RegressResponse(_Answer):
    mean: list[float] = Field(description="predictive mean of each query row")
    quantile_levels: list[float] = Field(default_factory=list)
    quantiles: Optional[list[list[float]]] = Field(None, description="(rows x levels) predictive quantiles")


class ImputeResponse(_Answer):
    table: Columns = Field(description="the query rows, missing cells filled (columns orientation)")
    n_filled: int = Field(description="cells that were missing and now hold a value")


class AnomalyResponse(_Answer):
    scores: list[float] = Field(description="score_samples: higher = more normal (IsolationForest's convention)")
    decision: list[float] = Field(description="scores - offset: negative = outlier")
    labels: list[int] = Field(description="-1 outlier, 1 inlier")
    offset: float = Field(description="the `contamination` quantile of the context rows' scores")


class ContextInfo(BaseModel):
    context_id: str
    task: Task
    target: Optional[str] = None
    columns: list[str] = Field(description="the feature columns query rows must have")
    n_rows: int
    classes: Optional[list[Cell]] = None
    offset: Optional[float] = Field(None, description="anomaly contexts: the decision offset")
    params: dict[str, Any] = Field(description="the estimator parameters, random_state drawn if it was null")
    bytes: int = Field(description="memory it holds now (fitted table + encoded contexts)")
    created: float = Field(description="unix time")
    last_used: float
    requests: int
    existed: bool = Field(False, description="registration found it already registered (same table and parameters)")
    warnings: list[str] = Field(default_factory=list, description="what the estimator warned about at fit")


class ContextList(BaseModel):
    contexts: list[ContextInfo]
    bytes: int
    limit_bytes: int


class ErrorResponse(BaseModel):
    error: str = Field(description="stable error code, e.g. too_many_rows, unknown_column, context_not_found")
    message: str
    field: Optional[str] = None
    column: Optional[str] = None
    row: Optional[int] = None
    limit: Optional[float] = None
    details: Optional[list[dict[str, Any]]] = None


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    models: dict[str, str] = Field(description="the weights that answer each task")
    lanes: int
    queued: int


class Info(BaseModel):
    models: dict[str, str] = Field(description="the weights that answer each task")
    version: str
    device: str
    batching: bool
    limits: dict[str, Union[int, float]]
    tasks: list[str]


REQUEST_MODELS = {"ClassifyRequest": ClassifyRequest, "RegressRequest": RegressRequest,
                  "ImputeRequest": ImputeRequest, "AnomalyRequest": AnomalyRequest, "RegisterRequest": RegisterRequest}
