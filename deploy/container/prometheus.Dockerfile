# Prometheus for the compose deployment: Debian 12's prometheus binary (a
# static Go program; the build context holds a copy of /usr/bin/prometheus)
# on the local base image, with prometheus.yml.
ARG BASE_IMAGE=local/debian:12
FROM ${BASE_IMAGE}
COPY prometheus /usr/bin/prometheus
COPY prometheus.yml /etc/prometheus/prometheus.yml
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus", "--config.file=/etc/prometheus/prometheus.yml", \
            "--storage.tsdb.path=/tmp/prometheus", "--web.listen-address=0.0.0.0:9090"]
