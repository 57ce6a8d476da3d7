//! Structured output requests: OpenAI's `response_format` and vLLM's `guided_json`,
//! `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`, read into one
//! [`GrammarSpec`] (the engine masks every choice by it; `dflash::grammar`).

use dflash::grammar::GrammarSpec;
use serde_json::{Map, Value};

/// A bad value: the request parameter it names and what is wrong.
#[derive(Debug, PartialEq)]
pub struct BadField {
    pub param: String,
    pub message: String,
}

fn bad(param: &str, message: impl Into<String>) -> BadField {
    BadField {
        param: param.into(),
        message: message.into(),
    }
}

/// The fields this module reads (the request's other fields are not its business).
pub const FIELDS: [&str; 6] = [
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
];

/// The request's grammar and the field that asks for it, if any (at most one field may).
pub fn grammar(obj: &Map<String, Value>) -> Result<Option<(String, GrammarSpec)>, BadField> {
    let mut found: Option<(&str, GrammarSpec)> = None;
    for field in FIELDS {
        let Some(v) = obj.get(field).filter(|v| !v.is_null()) else {
            continue;
        };
        let spec = match field {
            "response_format" => response_format(v)?,
            "structured_outputs" => structured_outputs(v)?,
            _ => Some(guided(field, v)?),
        };
        if let Some(spec) = spec {
            if let Some((first, _)) = &found {
                return Err(bad(
                    field,
                    format!("`{field}` and `{first}` both constrain the output; send one of them"),
                ));
            }
            found = Some((field, spec));
        }
    }
    Ok(found.map(|(f, s)| (f.to_string(), s)))
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with
/// `json_schema: {name, schema, strict, description}`.
fn response_format(v: &Value) -> Result<Option<GrammarSpec>, BadField> {
    const P: &str = "response_format";
    let o = v.as_object().ok_or_else(|| {
        bad(
            P,
            "`response_format` must be an object such as {\"type\": \"json_object\"}",
        )
    })?;
    let ty = o.get("type").and_then(Value::as_str).ok_or_else(|| {
        bad(
            P,
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"",
        )
    })?;
    let allowed: &[&str] = match ty {
        "text" | "json_object" => &["type"],
        "json_schema" => &["type", "json_schema"],
        other => {
            return Err(bad(
                P,
                format!("`response_format.type` {other:?} is not one of \"text\", \"json_object\", \"json_schema\""),
            ))
        }
    };
    if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(
            P,
            format!("`response_format.{k}` is not a field of a {ty:?} response format"),
        ));
    }
    Ok(match ty {
        "text" => None,
        "json_object" => Some(GrammarSpec::JsonObject),
        _ => {
            let js = o.get("json_schema").and_then(Value::as_object).ok_or_else(|| {
                bad(
                    P,
                    "`response_format.json_schema` must be an object with a `schema` (and a `name`)",
                )
            })?;
            for (k, v) in js {
                let ok = match k.as_str() {
                    "name" | "description" => v.is_string(),
                    "strict" => v.is_boolean() || v.is_null(),
                    "schema" => v.is_object() || v.is_boolean(),
                    _ => {
                        return Err(bad(
                            P,
                            format!("`response_format.json_schema.{k}` is not a field of a JSON schema format (name, description, schema, strict)"),
                        ))
                    }
                };
                if !ok {
                    return Err(bad(
                        P,
                        format!("`response_format.json_schema.{k}` has the wrong type"),
                    ));
                }
            }
            let schema = js.get("schema").ok_or_else(|| {
                bad(
                    P,
                    "`response_format.json_schema.schema` is missing (the JSON schema to follow)",
                )
            })?;
            Some(GrammarSpec::JsonSchema(schema.clone()))
        }
    })
}

/// vLLM's `guided_*` fields.
fn guided(field: &str, v: &Value) -> Result<GrammarSpec, BadField> {
    match field {
        "guided_json" => match v {
            Value::Object(_) | Value::Bool(_) => Ok(GrammarSpec::JsonSchema(v.clone())),
            // a schema sent as JSON text
            Value::String(s) => serde_json::from_str::<Value>(s)
                .ok()
                .filter(|v| v.is_object())
                .map(GrammarSpec::JsonSchema)
                .ok_or_else(|| bad(field, "`guided_json` text is not a JSON schema object")),
            _ => Err(bad(
                field,
                "`guided_json` must be a JSON schema (an object)",
            )),
        },
        "guided_regex" => v
            .as_str()
            .filter(|s| !s.is_empty())
            .map(|s| GrammarSpec::Regex(s.into()))
            .ok_or_else(|| {
                bad(
                    field,
                    "`guided_regex` must be a non-empty regular expression string",
                )
            }),
        "guided_grammar" => v
            .as_str()
            .filter(|s| !s.trim().is_empty())
            .map(|s| GrammarSpec::Lark(s.into()))
            .ok_or_else(|| {
                bad(
                    field,
                    "`guided_grammar` must be a Lark grammar string (llguidance's dialect)",
                )
            }),
        "guided_choice" => {
            let c: Option<Vec<String>> = v.as_array().and_then(|a| {
                a.iter()
                    .map(|x| x.as_str().map(String::from))
                    .collect::<Option<Vec<_>>>()
            });
            match c {
                Some(c) if !c.is_empty() && c.iter().all(|s| !s.is_empty()) => {
                    Ok(GrammarSpec::Choice(c))
                }
                _ => Err(bad(
                    field,
                    "`guided_choice` must be a non-empty array of non-empty strings",
                )),
            }
        }
        _ => unreachable!("FIELDS lists the guided fields"),
    }
}

/// vLLM's `structured_outputs: {json | regex | choice | grammar}` (exactly one key).
fn structured_outputs(v: &Value) -> Result<Option<GrammarSpec>, BadField> {
    const P: &str = "structured_outputs";
    let o = v.as_object().ok_or_else(|| {
        bad(
            P,
            "`structured_outputs` must be an object with one of json, regex, choice, grammar",
        )
    })?;
    let mut found = None;
    for (k, x) in o {
        let field = match k.as_str() {
            "json" => "guided_json",
            "regex" => "guided_regex",
            "choice" => "guided_choice",
            "grammar" => "guided_grammar",
            _ => {
                return Err(bad(
                    P,
                    format!(
                    "`structured_outputs.{k}` is not supported (json, regex, choice, grammar are)"
                ),
                ))
            }
        };
        if x.is_null() {
            continue;
        }
        if found.is_some() {
            return Err(bad(
                P,
                "`structured_outputs` takes one of json, regex, choice, grammar",
            ));
        }
        found = Some(guided(field, x).map_err(|e| BadField {
            param: P.into(),
            message: e.message.replace(field, &format!("structured_outputs.{k}")),
        })?);
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> Result<Option<GrammarSpec>, BadField> {
        grammar(v.as_object().unwrap()).map(|g| g.map(|(_, s)| s))
    }

    #[test]
    fn each_field_reads_into_its_grammar() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(read(json!({})), Ok(None));
        assert_eq!(read(json!({"response_format": {"type": "text"}})), Ok(None));
        assert_eq!(
            read(json!({"response_format": {"type": "json_object"}})),
            Ok(Some(GrammarSpec::JsonObject))
        );
        assert_eq!(
            read(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "a", "schema": schema, "strict": true}}})),
            Ok(Some(GrammarSpec::JsonSchema(schema.clone())))
        );
        assert_eq!(
            read(json!({"guided_json": schema.to_string()})),
            Ok(Some(GrammarSpec::JsonSchema(schema.clone())))
        );
        assert_eq!(
            read(json!({"guided_regex": "[0-9]+"})),
            Ok(Some(GrammarSpec::Regex("[0-9]+".into())))
        );
        assert_eq!(
            read(json!({"guided_choice": ["yes", "no"]})),
            Ok(Some(GrammarSpec::Choice(vec!["yes".into(), "no".into()])))
        );
        assert_eq!(
            read(json!({"guided_grammar": "start: \"x\""})),
            Ok(Some(GrammarSpec::Lark("start: \"x\"".into())))
        );
        assert_eq!(
            read(json!({"structured_outputs": {"choice": ["a", "b"]}})),
            Ok(Some(GrammarSpec::Choice(vec!["a".into(), "b".into()])))
        );
        // null is absent; text alongside a guided field is fine
        assert_eq!(
            read(
                json!({"response_format": {"type": "text"}, "guided_regex": "x", "guided_json": null})
            ),
            Ok(Some(GrammarSpec::Regex("x".into())))
        );
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases = [
            (
                json!({"response_format": "json"}),
                "response_format",
                "must be an object",
            ),
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format",
                "\"yaml\"",
            ),
            (
                json!({"response_format": {"type": "json_object", "schema": {}}}),
                "response_format",
                "response_format.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
                "json_schema` must be an object",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format",
                "schema` is missing",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}),
                "response_format",
                "strict` has the wrong type",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "format": 1}}}),
                "response_format",
                "json_schema.format",
            ),
            (
                json!({"guided_json": 3}),
                "guided_json",
                "must be a JSON schema",
            ),
            (
                json!({"guided_json": "not json"}),
                "guided_json",
                "not a JSON schema",
            ),
            (json!({"guided_regex": ""}), "guided_regex", "non-empty"),
            (
                json!({"guided_choice": []}),
                "guided_choice",
                "non-empty array",
            ),
            (
                json!({"guided_choice": ["a", 1]}),
                "guided_choice",
                "non-empty array",
            ),
            (json!({"guided_grammar": 5}), "guided_grammar", "Lark"),
            (
                json!({"structured_outputs": {"yaml": 1}}),
                "structured_outputs",
                "structured_outputs.yaml",
            ),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "structured_outputs",
                "one of",
            ),
            (
                json!({"structured_outputs": {"regex": 7}}),
                "structured_outputs",
                "structured_outputs.regex",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
                "both constrain",
            ),
        ];
        for (req, param, says) in cases {
            let e = read(req.clone()).expect_err(&req.to_string());
            assert_eq!(e.param, param, "{req}");
            assert!(e.message.contains(says), "{req}: {}", e.message);
            assert!(!e.message.contains('\n'), "one line: {}", e.message);
        }
    }
}
