"""The test suite: one folder per package (tempo/, mist/, ctapipe/, measure/), cross-cutting tests here.
Packages, so a folder named like the package it tests does not shadow it on import."""
