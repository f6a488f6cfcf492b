//! `dart_pruner::PrunerConfig` across the boundary in one piece: Python passes the
//! configuration as a dict (`dataclasses.asdict(PrunerConfig(...))`) and it is deserialized
//! into the Rust struct by its own `Deserialize` (unknown keys refused, missing ones defaulted),
//! so no field is spelled out here. Each value is a Python scalar (None, bool, int, float);
//! a value of the wrong type or range is an error naming the key and the value.

use std::fmt;

use dart_pruner::PrunerConfig;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};
use serde::de::value::{Error as DeError, MapDeserializer};
use serde::de::{self, Deserialize, IntoDeserializer, Visitor};
use serde::forward_to_deserialize_any;

use crate::errors::TokenOutOfVocabError;
use crate::pruner::PrunerError;

/// A Python scalar as serde sees it.
#[derive(Clone, Copy, Debug)]
enum Scalar {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::None => f.write_str("None"),
            Scalar::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            Scalar::Int(i) => write!(f, "{i}"),
            Scalar::Float(x) => write!(f, "{x}"),
        }
    }
}

/// One value with its key, so that an error names both.
struct Field {
    key: String,
    value: Scalar,
}

impl<'de> de::Deserializer<'de> for Field {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        let out: Result<V::Value, DeError> = match self.value {
            Scalar::None => visitor.visit_none(),
            Scalar::Bool(b) => visitor.visit_bool(b),
            Scalar::Int(i) => visitor.visit_i64(i),
            Scalar::Float(x) => visitor.visit_f64(x),
        };
        out.map_err(|e| de::Error::custom(format!("{} = {}: {e}", self.key, self.value)))
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.value {
            Scalar::None => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

impl<'de> IntoDeserializer<'de, DeError> for Field {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

fn scalar(key: &str, value: &Bound<'_, PyAny>) -> PyResult<Scalar> {
    if value.is_none() {
        return Ok(Scalar::None);
    }
    if let Ok(b) = value.cast::<PyBool>() {
        return Ok(Scalar::Bool(b.is_true()));
    }
    if let Ok(i) = value.extract::<i64>() {
        return Ok(Scalar::Int(i));
    }
    if let Ok(x) = value.extract::<f64>() {
        return Ok(Scalar::Float(x));
    }
    Err(PrunerError::new_err(format!(
        "{key} = {}: expected None, a bool, an int or a float",
        value.repr()?
    )))
}

/// The configuration a dict describes (see the module docs). A bad `eos_id` is a
/// `TokenOutOfVocabError`, anything else a `PrunerError`.
pub fn pruner_config(dict: &Bound<'_, PyDict>) -> PyResult<PrunerConfig> {
    let mut fields = Vec::with_capacity(dict.len());
    for (key, value) in dict.iter() {
        let key: String = key
            .extract()
            .map_err(|_| PrunerError::new_err("pruner configuration keys must be strings"))?;
        let value = scalar(&key, &value)?;
        fields.push((key.clone(), Field { key, value }));
    }
    let de = MapDeserializer::new(fields.into_iter());
    PrunerConfig::deserialize(de).map_err(|e| {
        let message = format!("pruner configuration: {e}");
        if e.to_string().starts_with("eos_id = ") {
            TokenOutOfVocabError::new_err(format!(
                "{e} (expected a token id, 0 <= id < vocabulary size)"
            ))
        } else {
            PrunerError::new_err(message)
        }
    })
}

/// `PrunerConfig::default()` as a dict (the Python dataclass's defaults are tested against it).
pub fn pruner_config_dict<'py>(
    py: Python<'py>,
    config: &PrunerConfig,
) -> PyResult<Bound<'py, PyDict>> {
    let value = serde_json::to_value(config)
        .map_err(|e| PrunerError::new_err(format!("pruner configuration: {e}")))?;
    let d = PyDict::new(py);
    let serde_json::Value::Object(map) = value else {
        return Err(PrunerError::new_err("pruner configuration: not a struct"));
    };
    for (key, v) in map {
        match v {
            serde_json::Value::Null => d.set_item(key, py.None())?,
            serde_json::Value::Bool(b) => d.set_item(key, b)?,
            serde_json::Value::Number(n) => {
                if let Some(u) = n.as_u64() {
                    d.set_item(key, u)?
                } else if let Some(i) = n.as_i64() {
                    d.set_item(key, i)?
                } else {
                    d.set_item(key, n.as_f64())?
                }
            }
            other => {
                return Err(PrunerError::new_err(format!(
                    "pruner configuration: {key} = {other} is not a scalar"
                )))
            }
        }
    }
    Ok(d)
}
