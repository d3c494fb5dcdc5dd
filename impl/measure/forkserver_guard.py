"""Imported first by a forkserver's preload (``mist.engine.profiler.ranks._RANK_PRELOAD``), for this
one effect: the server dies with the process that started it. It imports the rest of its preload
(torch.distributed, megatron-core: seconds on 2 cores) before it looks at its client again, so a
run ended in those seconds left it alive until they were over (probe round 5, F22). Here, not in
the profiler's package: importing that package imports torch first. Nothing else imports it."""

import os

from measure.parallel import die_with_parent

die_with_parent(os.getppid())
