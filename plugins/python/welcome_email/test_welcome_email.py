"""Unit tests of the handler's logic, with plain Python (no host):
``python -m unittest`` in this directory, with ``sdk/python`` on the path."""

import unittest

from khata_sdk import Fail, Job

from welcome_email import Welcome, id_text, message


class WelcomeEmailTest(unittest.TestCase):
    def test_the_message_greets_the_user_by_name(self):
        m = message(Welcome(7, "ada@example.com", "Ada"))
        self.assertEqual(m.to_addresses, ["ada@example.com"])
        self.assertEqual(m.subject, "Welcome, Ada!")
        self.assertTrue(m.text.startswith("Hello Ada,\n"))
        self.assertIsNone(m.sender)
        self.assertEqual(message(Welcome(7, "a@example.com", " ")).subject, "Welcome!")

    def test_user_ids_are_strings_or_non_negative_integers(self):
        self.assertEqual(id_text("user_id", 7), "7")
        self.assertEqual(id_text("user_id", "u-7"), "u-7")
        for bad in (-1, 1.5, "", None, [7], True):
            with self.assertRaises(Fail) as caught:
                id_text("user_id", bad)
            self.assertTrue(caught.exception.message.startswith("bad payload: user_id"))

    def test_a_payload_without_email_fails(self):
        with self.assertRaises(Fail) as caught:
            Job("j", "q", '{"user_id": 7, "name": "Ada"}').payload(Welcome)
        self.assertEqual(caught.exception.message, "bad payload: missing field `email`")


if __name__ == "__main__":
    unittest.main()
