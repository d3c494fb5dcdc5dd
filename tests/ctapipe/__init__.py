"""Tests of ctapipe."""
