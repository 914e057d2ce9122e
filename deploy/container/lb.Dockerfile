# The gRPC load balancer image: Debian 12's nginx (light) on the local base
# image (deploy/container/base_image.sh), with nginx.conf. The base image's
# apt sources name the Debian mirror debootstrap used.
ARG BASE_IMAGE=local/debian:12
FROM ${BASE_IMAGE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx-light \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
COPY nginx.conf /etc/nginx/nginx.conf
RUN nginx -t -c /etc/nginx/nginx.conf
USER www-data
EXPOSE 50051
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
