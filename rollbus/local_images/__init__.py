"""Container images built on this machine where no container registry serves (and on air-gapped clusters).

Each image is built from a recipe folder shipped with rollbus on the Debian base made by ``mmdebstrap``
(:mod:`rollbus.sandbox.docker_images`), tagged by a content key, so a second build builds nothing:
``python:3.11-slim-bookworm``'s equivalent (:mod:`rollbus.local_images.python_base`), the Kafka image
(:mod:`rollbus.kafka.image`) and the rollbus image of ``compose/`` (:mod:`rollbus.local_images.cli`).
"""
