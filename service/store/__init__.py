"""What the service keeps: the database (:mod:`.db`: engines, sessions, migrations, outages) and its
tables (:mod:`.models`), the spec store (:mod:`.spec_store`), the leased job queue
(:mod:`.job_queue`, :mod:`.job_outcome`), the kernel cache (:mod:`.kernel_cache`) and the bundles a
server serves (:mod:`.served_bundles`). Import the modules, not this package."""
