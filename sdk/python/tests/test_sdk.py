"""Tests of the SDK's pure parts, with plain Python (no host, no build):
``python3 -m unittest discover -s sdk/python/tests`` from the repository."""

import dataclasses
import doctest
import tempfile
import unittest
from pathlib import Path

import khata_sdk
from khata_sdk import (
    Denied,
    Fail,
    Fenced,
    InProgress,
    Invalid,
    Job,
    KeyReused,
    NoHost,
    Rejected,
    Retry,
    Transient,
    Uncertain,
    build,
    email,
    http,
    job,
    kv,
)
from khata_sdk._run import run


@dataclasses.dataclass
class Order:
    order_id: int
    currency: str
    note: str = ""


class JobTest(unittest.TestCase):
    def test_a_payload_parses_into_a_dataclass_checking_fields(self):
        order = Job("j", "q", '{"order_id": 4, "currency": "EUR", "extra": 1}').payload(Order)
        self.assertEqual(order, Order(4, "EUR"))
        cases = {
            '{"currency": "EUR"}': "bad payload: missing field `order_id`",
            '{"order_id": "4", "currency": "EUR"}':
                'bad payload: field `order_id` must be an integer, got string "4"',
            '{"order_id": true, "currency": "EUR"}':
                "bad payload: field `order_id` must be an integer, got boolean true",
            "[1]": "bad payload: expected an object, got an array",
        }
        for text, message in cases.items():
            with self.assertRaises(Fail) as caught:
                Job("j", "q", text).payload(Order)
            self.assertEqual(caught.exception.message, message)
        with self.assertRaises(Fail) as caught:
            Job("j", "q", "{nope").payload()
        self.assertTrue(caught.exception.message.startswith("bad payload: Expecting"))


class RunTest(unittest.TestCase):
    def test_results_become_json_text_and_errors_retry_or_fail(self):
        def ok(j):
            return {"a": 1, "attempt": j.attempt}

        self.assertEqual(run(ok, Job("j", "q", "{}", attempt=2)), '{"a":1,"attempt":2}')
        for raised, kind, message in [
            (Retry("later"), Retry, "later"),
            (Fail("never"), Fail, "never"),
            (Transient("smtp down"), Retry, "effect transient: smtp down"),
            (KeyReused("other request"), Fail, "effect key-reused: other request"),
            (ZeroDivisionError("division by zero"), Fail,
             "unhandled ZeroDivisionError: division by zero"),
        ]:
            def handler(j, raised=raised):
                raise raised

            with self.assertRaises(kind) as caught:
                run(handler, Job("j", "q", "{}"))
            self.assertEqual(caught.exception.message, message)
        with self.assertRaises(Fail) as caught:
            run(lambda j: {1, 2}, Job("j", "q", "{}"))
        self.assertTrue(caught.exception.message.startswith("the result is not JSON"))

    def test_effect_errors_retry_only_when_another_attempt_can_succeed(self):
        for cls in (InProgress, Transient, Fenced):
            self.assertTrue(cls("x").to_error().is_retry())
        for cls in (Denied, KeyReused, Rejected, Invalid, Uncertain):
            self.assertFalse(cls("x").to_error().is_retry())

    def test_effects_outside_a_component_raise_no_host(self):
        with self.assertRaises(NoHost):
            kv.put("k", "v")


class BuildersTest(unittest.TestCase):
    def test_json_requests_and_messages(self):
        r = http.post("payments", "/v1/charges").header("x-trace", "1").json({"amount": 5})
        self.assertEqual(r.body, b'{"amount":5}')
        self.assertIn(("content-type", "application/json"), r.headers)
        response = http.Response(201, [("Content-Type", "application/json")], b'{"id":"ch_1"}', True)
        self.assertTrue(response.is_success())
        self.assertEqual(response.header("content-type"), "application/json")
        self.assertEqual(response.json(), {"id": "ch_1"})
        m = email.Message("Hi", "Hello.").to("a@example.com").from_("b@example.com")
        self.assertEqual((m.to_addresses, m.sender), (["a@example.com"], "b@example.com"))


class BuildTest(unittest.TestCase):
    def test_the_world_imports_what_the_handler_imports(self):
        cases = {
            "from khata_sdk import Job, kv, email\n": {"kv", "email"},
            "import khata_sdk.http\n": {"http"},
            "from khata_sdk.index import upsert\n": {"index"},
            "import khata_sdk as k\nk.kv.put('a', 'b')\n": {"kv"},
            "import json\nfrom khata_sdk import Job, handler\n": set(),
        }
        for source, expected in cases.items():
            self.assertEqual(build.used_interfaces(source, "h.py"), expected, source)
        with self.assertRaises(build.BuildError) as caught:
            build.used_interfaces("\n\nfrom khata_sdk import *\n", "h.py")
        self.assertTrue(str(caught.exception).startswith("h.py:3: `from khata_sdk import *`"))
        with self.assertRaises(build.BuildError) as caught:
            build.used_interfaces("def f(:\n", "h.py")
        self.assertTrue(str(caught.exception).startswith("h.py:1:"))

    def test_the_world_names_only_the_imports(self):
        world = build.world_source("package khata:plugin@0.1.0;", {"email", "log"})
        self.assertIn("  import email;\n  import log;\n", world)
        self.assertNotIn("import kv;", world)

    def test_bad_arguments_are_named(self):
        with tempfile.TemporaryDirectory() as tmp:
            handler = Path(tmp) / "my-handler.py"
            handler.write_text("")
            out = Path(tmp) / "out.wasm"
            with self.assertRaises(build.BuildError) as caught:
                build.build(handler, out, build.default_wit())
            self.assertIn("must be a Python module name", str(caught.exception))
            ok = Path(tmp) / "h.py"
            ok.write_text("")
            with self.assertRaises(build.BuildError) as caught:
                build.build(ok, out, Path(tmp) / "nowit")
            self.assertIn("no such WIT directory", str(caught.exception))
            with self.assertRaises(build.BuildError) as caught:
                build.build(ok, out, build.default_wit(), imports={"kv", "files"})
            self.assertIn("unknown interface files", str(caught.exception))


class DocsTest(unittest.TestCase):
    def test_docstring_examples(self):
        for module in (khata_sdk.errors, job, email, http):
            result = doctest.testmod(module)
            self.assertEqual(result.failed, 0, module.__name__)


if __name__ == "__main__":
    unittest.main()
