"""The task text: documents (:mod:`bake.corpus.documents`), the held-out / test / calibration
splits (:mod:`bake.corpus.splits`) and safe recursive globbing (:mod:`bake.corpus.globbing`)."""
